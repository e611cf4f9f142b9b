from setuptools import find_packages, setup

setup(
    name="megatron_apriel",
    version="0.1.0",
    description="Megatron-Core RL post-training backend reproducing the Apriel-1.5-OpenReasoner recipe",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_apriel", "megatron_apriel.*"]),
    package_data={"megatron_apriel": ["conf/*.yaml", "conf/models/*/config.json", "eval/steps/prompts_v*.yaml"]},
    install_requires=[
        # torch is installed first, explicitly (see README): a bare "torch" here would let pip
        # pull a CUDA build on a CPU machine.
        "torch>=2.4",
        # 0.16.1 is the newest release for Python 3.11 (CI); clusters on 3.12 run 0.19.x.
        "megatron-core>=0.16.1,<0.20",
        "hydra-core>=1.3,<1.4",
        "pyyaml>=6",  # apriel-plan reads a preset's defaults list (already required by omegaconf)
        "numpy",
        "safetensors>=0.4",
        "transformers>=4.45",
        "tensorboard",
        "tqdm",
        # apriel-eval's plots (accuracy vs tokens, lengths, budgets, training curves)
        "matplotlib>=3.8",
        # Megatron's checkpoint writer needs it; without it the forked writers die and save hangs.
        "psutil",
        # the weight updates' cost, read from vLLM's /metrics (vLLM requires it too)
        "prometheus-client>=0.17",
        "httpx>=0.27,<1",
        "pydantic>=2",
        "datasets>=3.0",
        # verifiers; hydra pins antlr 4.9.3, hence math-verify's matching extra
        "math-verify[antlr4-9-3]>=0.9,<0.10",
        "if-verifiable>=0.1.2,<0.2",
        "reasoning-gym>=0.1.25,<0.2",
    ],
    extras_require={
        # Also bfcl-eval==2026.3.23, installed with --no-deps by tools/setup_cpu_env.sh: listed here,
        # pip would follow its pins (numpy 1.26, sentence-transformers, faiss, API clients).
        # ruff: `ruff check .` runs in .ci/run before the tests (ruff.toml); its rules change between minors
        "test": ["pytest>=8", "ruff>=0.17,<0.18"],
        # NVIDIA Apex is not on PyPI (the "apex" there is another project): build it from
        # github.com/NVIDIA/apex if wanted; Megatron falls back to torch kernels without it.
        # vLLM: the range whose RL routes and weight-transfer API we test (the CPU build is 0.32.0).
        "gpu": ["transformer-engine[pytorch]", "vllm>=0.32,<0.33"],
    },
    entry_points={
        "console_scripts": [
            "apriel-train=megatron_apriel.entrypoints.train:main",
            "apriel-convert=megatron_apriel.entrypoints.convert:main",
            "apriel-serve=megatron_apriel.entrypoints.serve:main",
            "apriel-plan=megatron_apriel.entrypoints.plan:main",
            "apriel-submit=megatron_apriel.entrypoints.submit:main",
            "apriel-eval=megatron_apriel.entrypoints.eval:main",
        ],
    },
)

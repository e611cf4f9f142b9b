"""The durable rollout stream: append-only segment files under ``run_dir/rollouts/``.

The actor appends finished groups; the trainer reads them in order with a cursor it saves in its
checkpoints. Nothing here needs a server, a lock or mmap: only ``write, fsync, rename``, which is
atomic on a local disk and on NFS/Lustre, so a reader never sees a partial segment and a writer
killed mid-write leaves only a hidden temporary file that every reader ignores.

Layout::

    rollouts/
      seg_000000000000.json   groups 0..k-1, plus the actor's state after them
      seg_00000000000k.json   groups k..m-1, ...
      trainer.json            the trainer's progress (cursor, step, version): the actor's admission input

A segment's name is the sequence number of its first group, and each segment starts where the
previous one ended, so a reader at cursor ``c`` finds its next file by name (one ``stat``, no
directory listing) once it has found the segment holding ``c``. Every segment carries the actor's
snapshot as of its last group (sampler counts and RNG, data order, next sequence number, the
groups still in flight), so a restarted actor continues from the last segment alone.
Records are validated on read; a reader refuses a segment of another schema version.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional

from pydantic import Field, model_validator

from megatron_apriel.files import atomic_write
from megatron_apriel.records.base import Record
from megatron_apriel.records.rollouts import RolloutGroup

STREAM_VERSION = 1
_SEGMENT = re.compile(r"^seg_(\d{12})\.json$")
PROGRESS_FILE = "trainer.json"


class _StreamRecord(Record):
    """A stream file's top-level record: its ``stream_version`` must be this code's."""

    VERSION_FIELD: ClassVar[str] = "stream_version"
    VERSION: ClassVar[int] = STREAM_VERSION
    MISMATCH: ClassVar[str] = "continue the run with the megatron_apriel version that wrote it."
    stream_version: int = STREAM_VERSION


class PendingGroup(Record):
    """A problem the actor had admitted but not finished when it wrote a snapshot."""

    problem_id: str
    domain: str
    admitted_version: int


class ActorSnapshot(_StreamRecord):
    kind: Literal["actor_snapshot"] = "actor_snapshot"
    next_seq: int = Field(ge=0)
    sampler: dict[str, Any]
    """`AdaptiveDomainSampler.state_dict()`."""
    order: dict[str, Any]
    """`DomainOrder.state_dict()`."""
    in_flight: list[PendingGroup] = Field(default_factory=list)
    """Admitted, not yet in the stream: regenerated first by a restarted actor."""


class Segment(_StreamRecord):
    kind: Literal["segment"] = "segment"
    first_seq: int = Field(ge=0)
    groups: list[RolloutGroup] = Field(min_length=1)
    actor: ActorSnapshot

    @model_validator(mode="after")
    def _contiguous(self):
        seqs = [g.seq for g in self.groups]
        if seqs != list(range(self.first_seq, self.first_seq + len(seqs))):
            raise ValueError(f"segment at {self.first_seq} holds groups {seqs[:5]}...: not contiguous.")
        if self.actor.next_seq != self.first_seq + len(seqs):
            raise ValueError(f"segment at {self.first_seq}: actor snapshot says next_seq {self.actor.next_seq}, "
                             f"expected {self.first_seq + len(seqs)}.")
        return self


class TrainerProgress(_StreamRecord):
    """What the trainer has consumed and which weights the fleet serves (written by trainer rank 0)."""

    kind: Literal["trainer_progress"] = "trainer_progress"
    step: int = Field(ge=0)
    """The step whose groups are being read now (or next)."""
    filled: int = Field(ge=0)
    """Usable groups already read for ``step``."""
    cursor: int = Field(ge=0)
    """Sequence number of the next group the trainer will read."""
    version: int = Field(ge=0)
    """Weight version every server has been sent (the fleet serves at least this)."""


def segment_path(root: Path, first_seq: int) -> Path:
    return root / f"seg_{first_seq:012d}.json"


def list_segments(root: Path) -> list[int]:
    """First sequence numbers of the complete segments, ascending (temporary files are ignored)."""
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for name in os.listdir(root) if (m := _SEGMENT.match(name)))


def read_segment(path: Path) -> Segment:
    try:
        segment = Segment.model_validate_json(path.read_bytes())
    except ValueError as err:
        raise ValueError(f"{path}: not a valid rollout segment ({err}). The stream was written by another "
                         "version or damaged; restore it or start a new run_dir.") from err
    if segment_path(path.parent, segment.first_seq).name != path.name:
        raise ValueError(f"{path}: holds groups from {segment.first_seq}; the file was renamed by hand.")
    return segment


class StreamWriter:
    """The actor's side: assigns sequence numbers and writes each batch of groups as one segment."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".seg_*.tmp-*"):  # a writer that died mid-write
            stale.unlink(missing_ok=True)
        firsts = list_segments(self.root)
        self.next_seq = read_segment(segment_path(self.root, firsts[-1])).actor.next_seq if firsts else 0

    def last_snapshot(self) -> Optional[ActorSnapshot]:
        firsts = list_segments(self.root)
        return read_segment(segment_path(self.root, firsts[-1])).actor if firsts else None

    def append(self, groups: list[RolloutGroup], snapshot: ActorSnapshot) -> list[RolloutGroup]:
        """Number ``groups`` from ``next_seq`` on and write them (durably) with ``snapshot``, whose
        ``next_seq`` must already count them. Returns the numbered groups."""
        first = self.next_seq
        numbered = [g.model_copy(update={"seq": first + i}) for i, g in enumerate(groups)]
        segment = Segment(first_seq=first, groups=numbered, actor=snapshot)
        try:
            atomic_write(segment_path(self.root, first), segment.model_dump_json().encode())
        except OSError as err:
            raise OSError(err.errno, f"cannot write rollout segment {first} into {self.root} ({err.strerror}); "
                          "the stream is intact up to the previous segment. Free space or fix the mount, then "
                          "restart: the actor resumes from its last segment.") from err
        self.next_seq = first + len(numbered)
        return numbered


class StreamReader:
    """The trainer's side: groups in sequence order from ``cursor`` on, as they appear."""

    def __init__(self, root: str | Path, cursor: int = 0):
        self.root = Path(root)
        self.cursor = cursor
        self._buffer: list[RolloutGroup] = []
        self._next_first: Optional[int] = None  # first seq of the next segment file to open
        self.segment_first: Optional[int] = None
        """First seq of the segment the last returned group came from (its file name)."""

    def _locate(self) -> bool:
        """Find the segment holding ``cursor`` (one directory listing, at start or resume)."""
        firsts = [f for f in list_segments(self.root) if f <= self.cursor]
        if not firsts:
            return False
        segment = read_segment(segment_path(self.root, firsts[-1]))
        if segment.first_seq + len(segment.groups) <= self.cursor:
            self._next_first = segment.first_seq + len(segment.groups)
            return self._load_next()
        self._buffer = [g for g in segment.groups if g.seq >= self.cursor]
        self._next_first = segment.first_seq + len(segment.groups)
        self.segment_first = segment.first_seq
        return True

    def _load_next(self) -> bool:
        path = segment_path(self.root, self._next_first)
        if not path.exists():
            return False
        segment = read_segment(path)
        self._buffer = list(segment.groups)
        self._next_first = segment.first_seq + len(segment.groups)
        self.segment_first = segment.first_seq
        return True

    def next_group(self) -> Optional[RolloutGroup]:
        """The group at ``cursor`` (and advance), or None if it has not been written yet."""
        if not self._buffer:
            found = self._locate() if self._next_first is None else self._load_next()
            if not found:
                return None
        group = self._buffer.pop(0)
        if group.seq != self.cursor:
            raise RuntimeError(f"rollout stream out of order: expected group {self.cursor}, read {group.seq}.")
        self.cursor += 1
        return group

    def read_all(self) -> list[RolloutGroup]:
        """Every group written so far from ``cursor`` on, in order (a finished run's stream)."""
        out = []
        while (group := self.next_group()) is not None:
            out.append(group)
        return out


def write_progress(root: str | Path, progress: TrainerProgress) -> None:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    atomic_write(root / PROGRESS_FILE, progress.model_dump_json().encode())


def clear_progress(root: str | Path) -> None:
    """Forget a previous trainer's progress before a (re)start of the whole run: it may name a
    newer version than the resumed checkpoint's, and the actor must wait for the new trainer's
    first publication (made once the fleet serves its weights) rather than admit on a stale one."""
    (Path(root) / PROGRESS_FILE).unlink(missing_ok=True)


def read_progress(root: str | Path) -> Optional[TrainerProgress]:
    path = Path(root) / PROGRESS_FILE
    try:
        return TrainerProgress.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return None

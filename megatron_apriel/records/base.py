"""`Record`: the one base of every typed message that crosses a process boundary (the rollout
stream's files, the trainer's progress, the weight-sync messages).

One rule for all of them:
- frozen, and an unknown field is an error (a typo or a newer writer is never silently ignored);
- two records are equal when their wire forms (JSON) are, so arrays compare bit for bit;
- a top-level record names its ``kind`` (a ``Literal`` field) and carries a version field; the
  family declares the field's name (``VERSION_FIELD``), the version it writes (``VERSION``) and the
  older ones it still reads (``READS``). A record of any other version is refused with a message
  that says which versions this code speaks and what to do (``MISMATCH``).

A part of a record (a span, a bucket's slot) derives from `Record` and declares no version: it is
read under its parent's.
"""

from __future__ import annotations

from typing import ClassVar, Optional

from pydantic import BaseModel, ConfigDict, model_validator


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    VERSION_FIELD: ClassVar[Optional[str]] = None
    """The version field's name on the wire (families keep the name they were first written with)."""
    VERSION: ClassVar[int] = 0
    """The version this code writes (the version field's default)."""
    READS: ClassVar[tuple[int, ...]] = ()
    """Older versions this code still reads, besides ``VERSION``."""
    MISMATCH: ClassVar[str] = "read it with the megatron_apriel version that wrote it."
    """What to do about a record of a version this code does not speak."""

    @model_validator(mode="after")
    def _known_version(self):
        if self.VERSION_FIELD is not None:
            got, speaks = getattr(self, self.VERSION_FIELD), (*self.READS, self.VERSION)
            if got not in speaks:
                raise ValueError(f"{type(self).__name__} has {self.VERSION_FIELD} {got}, this code speaks "
                                 f"{', '.join(map(str, speaks))}; {self.MISMATCH}")
        return self

    def __eq__(self, other) -> bool:
        """Equal when their wire forms are (arrays compared bit for bit)."""
        return type(other) is type(self) and self.model_dump_json() == other.model_dump_json()

    def __hash__(self) -> int:
        return hash(self.model_dump_json())

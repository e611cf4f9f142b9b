"""Every strategy a config key names is declared once, as a ``Literal`` type; the config field
stays ``str`` (OmegaConf's structured configs take no ``Literal``) and is checked against it here."""

from __future__ import annotations

from typing import Literal, Optional, get_args

RolloutSource = Literal["local", "fleet", "replay"]
LossKind = Literal["gspo", "gspo_token", "grpo"]
Correction = Literal["none", "token_tis", "seq_tis", "seq_is", "token_mask", "seq_mask"]
CorrectionAnchor = Literal["behaviour", "current"]
CorrectionCount = Literal["all", "kept"]
BeforeTrip = Literal["train", "drop"]
TokenDispatcher = Literal["auto", "allgather", "alltoall"]
Fp8Format = Literal["hybrid", "e4m3"]
Fp8Recipe = Literal["delayed", "tensorwise", "blockwise", "mxfp8"]
CpCommType = Literal["p2p", "all_gather", "a2a", "a2a+p2p"]
WireDtype = Literal["float32", "bfloat16", "float16"]
KvOnUpdate = Literal["recompute", "keep"]


def choices(kind) -> tuple[str, ...]:
    """The values of a ``Literal`` type, in declaration order."""
    return get_args(kind)


def check_choice(key: str, value: Optional[str], kind, allow_none: bool = False) -> None:
    """A refusal naming ``key`` unless ``value`` is one of ``kind``'s values (or None, if allowed)."""
    if value is None and allow_none:
        return
    if value not in choices(kind):
        null = "null or " if allow_none else ""
        raise ValueError(f"{key} must be {null}one of {choices(kind)}, got {value!r}.")

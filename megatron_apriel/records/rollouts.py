"""Records that flow from the datasets through the actor into the durable stream and the trainer.

- `Problem`: a dataset row after normalisation, the prompt the policy sees and the reference its
  verifier needs.
- `RolloutGroup` / `Rollout`: the G trajectories of one problem as the actor writes them into the
  stream (typed, versioned, JSON-serialisable): token ids, which of them the model sampled (its
  turns; the rest are the environment's), behaviour log-probs and the weight-version spans of the
  model's tokens, the verifier's verdict, raw and shaped rewards, advantages, timings and the
  group's sequence number. A single-turn completion is the one-turn trajectory.
- `TrainSample`: the view of one rollout that the trainer's batcher packs (``records/samples.py``).
"""

from __future__ import annotations

import base64
import enum
import io
import json
import math
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, Optional, Sequence

import numpy as np
from pydantic import Field, PlainSerializer, PlainValidator, model_validator

import megatron_apriel.records.npy_base64 as npy_base64
from megatron_apriel.records.base import Record
from megatron_apriel.records.samples import TrainSample, balance_by_tokens, routing_rows  # noqa: F401 (re-exported)

DOMAINS: tuple[str, ...] = ("math", "code", "logic", "ifeval", "function_calling")
"""The five verifiable-reward domains of the recipe (RECIPE.md section 6)."""

EVAL_DOMAINS: tuple[str, ...] = ("multiple_choice",)
"""Domains that only evaluation scores (GPQA-Diamond, MMLU-Pro; `megatron_apriel.eval.scoring`):
a Problem may carry one, but no training verifier, domain mix or sampler knows it."""

_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Problem:
    """One prompt of one domain, with what its verifier needs to score a completion.

    Attributes:
        id: unique within its dataset file (used for logging, data order and de-duplication).
        domain: one of `DOMAINS` (or `EVAL_DOMAINS`, for evaluation only); selects the verifier.
        prompt: chat messages, each `{"role": ..., "content": str}`, in order.
        reference: domain-specific, JSON-serialisable ground truth (see each verifier's docstring).
        metadata: free-form JSON-serialisable extras (source dataset, difficulty, tools, ...).
    """

    id: str
    domain: str
    prompt: list[dict[str, str]]
    reference: Any
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.domain not in DOMAINS + EVAL_DOMAINS:
            raise ValueError(f"Problem {self.id!r}: unknown domain {self.domain!r}; use one of {DOMAINS} "
                             f"(or, for evaluation only, {EVAL_DOMAINS}).")
        if not self.prompt:
            raise ValueError(f"Problem {self.id!r}: empty prompt; give at least one user message.")
        for message in self.prompt:
            if set(message) != {"role", "content"} or message["role"] not in _ROLES:
                raise ValueError(
                    f"Problem {self.id!r}: bad message {message!r}; each message needs exactly "
                    f"'role' (one of {_ROLES}) and 'content'."
                )
            if not isinstance(message["content"], str):
                raise ValueError(f"Problem {self.id!r}: message content must be a string.")
        try:
            json.dumps(self.reference)
            json.dumps(self.metadata)
        except TypeError as err:
            raise ValueError(f"Problem {self.id!r}: reference and metadata must be JSON-serialisable ({err}).") from err


# --- rollout records: what the actor writes into the stream and the trainer reads back ---------

class Outcome(str, enum.Enum):
    """Why a completion got its score."""

    CORRECT = "correct"
    WRONG = "wrong"
    NO_ANSWER = "no_answer"
    """The completion contains no answer in the expected place (no \\boxed{}, no code block, ...)."""
    UNPARSABLE = "unparsable"
    """An answer is present but cannot be read (bad JSON, unparsable maths, ...)."""
    TIMEOUT = "timeout"
    """The model's answer ran out of time (slow code, pathological expression)."""
    VERIFIER_ERROR = "verifier_error"
    """The verifier itself failed: not the model's fault; the trainer may drop the rollout."""



SCHEMA_VERSION = 5
"""Format version of `RolloutGroup` written now; a reader refuses any it does not know (old runs are
not silently misread). 5: ``context_versions`` (the KV cache a token was sampled over, under
``fleet.kv_on_update=keep``); 4: multi-turn trajectories (``model_turns``, ``truncated``; log-probs and
version spans per model token); 3: rollouts may carry their ``routed_experts``; 2: the verifier's
``detail``. 1 to 3 are still read, each rollout as one model turn over its whole completion,
truncated when vLLM stopped it at the length limit."""
READ_SCHEMA_VERSIONS = (1, 2, 3, 4, 5)
"""Every ``schema_version`` a reader accepts (``RolloutGroup.READS`` plus ``SCHEMA_VERSION``)."""


def _encode_array(values, dtype: str) -> str:
    return base64.b64encode(np.asarray(values, dtype=dtype).tobytes()).decode("ascii")


def _validate_array(value, dtype: str, what: str) -> np.ndarray:
    if isinstance(value, str):  # the stream's compact form
        array = np.frombuffer(base64.b64decode(value), dtype=dtype)
    else:
        array = np.array(value, dtype=dtype)
        if array.ndim != 1:
            raise ValueError(f"{what} must be a flat sequence, got shape {array.shape}.")
    array.flags.writeable = False
    return array


def _array(dtype: str, what: str):
    """A 1-D read-only numpy array of ``dtype``: decoded from the stream's base64 without a copy
    or a Python list, or converted from a sequence (what vLLM's client returns)."""
    def validate(value) -> np.ndarray:
        return _validate_array(value, dtype, what)
    return Annotated[np.ndarray, PlainValidator(validate),
                     PlainSerializer(lambda v: _encode_array(v, dtype), when_used="json")]


TokenIds = _array("<i4", "token ids")
"""Token ids; stored as base64 little-endian int32 in JSON (5.3 bytes a token instead of ~6-7),
held as a read-only int32 array from the stream to the trainer's tensors."""
LogProbs = _array("<f4", "log-probs")
"""Log-probs; stored as base64 float32 (vLLM computes them in float32, so nothing is lost)."""


DETAIL_CHARS = 500
"""The longest verifier note a rollout record keeps (a sandbox traceback is cut, not dropped)."""


class RoutedExperts(Record):
    """The experts vLLM routed each token of a sequence to, as its server returned them: ``[prompt +
    completion - 1, num_hidden_layers, top_k]`` expert ids (the last sampled token never ran through
    the model; a dense layer's rows are zeros), in the narrowest unsigned type (1 byte per token,
    layer and k up to 256 experts). Stored as the server sent them, base64 of an ``.npy``: the
    actor's cost of a record is then a header read, not a decode and re-encode of every id."""

    shape: tuple[int, int, int]
    dtype: Literal["uint8", "uint16"]
    data: str
    """Base64 of the ``.npy`` bytes (a C-ordered array of ``shape`` and ``dtype``)."""

    @classmethod
    def from_array(cls, ids: np.ndarray) -> "RoutedExperts":
        if ids.ndim != 3 or ids.dtype.name not in ("uint8", "uint16"):
            raise ValueError(f"routed experts must be [tokens, layers, k] uint8/uint16, got {ids.shape} {ids.dtype}.")
        buf = io.BytesIO()
        np.save(buf, np.ascontiguousarray(ids), allow_pickle=False)
        return cls(shape=ids.shape, dtype=ids.dtype.name, data=base64.b64encode(buf.getvalue()).decode("ascii"))

    @classmethod
    def from_npy_base64(cls, data: str) -> "RoutedExperts":
        """vLLM's ``routed_experts`` field (base64 ``.npy``), kept verbatim when its ids are already
        uint8/uint16 (apriel-serve's are); other integer types are narrowed once."""
        shape, dtype, fortran = npy_base64.header(data)
        if len(shape) == 3 and dtype.name in ("uint8", "uint16") and not fortran:
            return cls(shape=shape, dtype=dtype.name, data=data)
        ids = np.load(io.BytesIO(base64.b64decode(data)), allow_pickle=False)
        if ids.ndim != 3 or ids.dtype.kind not in "iu" or (ids.size and (ids.min() < 0 or ids.max() > 65535)):
            raise ValueError(f"routed experts must be [tokens, layers, k] expert ids, got {ids.shape} {ids.dtype}.")
        return cls.from_array(ids.astype(np.uint8 if ids.size == 0 or ids.max() < 256 else np.uint16))

    def array(self) -> np.ndarray:
        out = np.load(io.BytesIO(base64.b64decode(self.data)), allow_pickle=False)
        out.flags.writeable = False
        return out

    @model_validator(mode="after")
    def _size(self):
        """From the header's length and the base64 length, without decoding the ids (a record is
        validated on every read)."""
        if not npy_base64.holds(self.data, math.prod(self.shape) * np.dtype(self.dtype).itemsize):
            raise ValueError(f"routed experts data does not hold {self.shape} {self.dtype} ids.")
        return self


class VersionSpan(Record):
    """Model tokens ``[start, end)`` (counted over the model's tokens only) were sampled by the
    weights of ``version``."""

    version: int = Field(ge=0)
    start: int = Field(ge=0)
    end: int = Field(ge=0)


class ModelTurn(Record):
    """Completion tokens ``[start, end)`` are one model turn: ids exactly as vLLM sampled them."""

    start: int = Field(ge=0)
    end: int = Field(ge=0)


class Rollout(Record):
    """One trajectory of a group, with its verdict and the rewards derived from it.

    ``completion_ids`` is everything after the prompt, as one id array: the model's turns
    (``model_turns``) with the environment's tokens between them (each tool or user turn's chat
    template ids, appended after the model's, never re-rendered). Only the model's tokens carry a
    loss; ``logprobs`` and ``versions`` count them alone (the k-th model token is ``mask``'s k-th
    one). A single-turn completion is one model turn over the whole completion, with nothing of the
    environment's."""

    completion_ids: TokenIds
    logprobs: LogProbs
    """Behaviour log-prob of each model token (vLLM, after temperature), in order: pi_old of the loss."""
    versions: list[VersionSpan]
    """Weight versions the model tokens were sampled under, in order (two or more: updated in
    flight, between turns or inside one)."""
    model_turns: list[ModelTurn]
    """The model's turns, in order, with at least one environment token between two of them; the
    last ends the completion (environment tokens after it would carry no loss and have no routes:
    leave them out). Omitted (streams before schema 4, and what a single-turn writer may leave
    out): one turn over the whole completion."""
    finish_reason: str
    """vLLM's, for the last model turn: stop (EOS or a stop string), length (hit the output budget), ..."""
    truncated: bool
    """The trajectory did not end by itself: its last turn hit the length limit, or the actor
    stopped it at its turn or token limits (overlong filtering keeps it out of the loss). Omitted:
    ``finish_reason == "length"``."""
    outcome: Outcome
    """The verifier's verdict (a string in the stream: correct, wrong, no_answer, unparsable,
    timeout, verifier_error)."""
    detail: str = Field(default="", max_length=DETAIL_CHARS)
    """The verifier's note on its verdict (why the answer is wrong, or why the verifier failed),
    cut to ``DETAIL_CHARS``; empty in streams written before it was recorded."""
    score: float = Field(ge=0.0, le=1.0)
    """Task reward R in [0, 1] (partial credit allowed)."""
    success: bool
    reward: float
    """Shaped reward R + lambda * P(length) (length penalty, difficulty-aware when DAP is on)."""
    advantage: float
    server: str = ""
    attempts: int = Field(default=1, ge=1)
    routed_experts: Optional[RoutedExperts] = None
    """The experts vLLM routed the prompt and completion tokens to (``apriel-serve
    --return-routed-experts``, for rollout routing replay), the environment's tokens included: vLLM
    routes them when it prefills them for the next turn, as it routes the prompt; None: not recorded."""
    context_versions: list[VersionSpan] = Field(default_factory=list)
    """Model tokens ``[start, end)`` were sampled over a KV cache computed by weights no older than
    ``version`` (spans over model tokens, as ``versions``). With ``fleet.kv_on_update=keep`` a
    request keeps its cache across a weight update, so a token sampled by newer weights may attend
    over keys and values the older ones computed: its context version is below its own (``stale_cache``).
    Empty: every token's context is as new as the token (``recompute``: the cache is rebuilt at each
    update; streams before schema 5)."""

    @model_validator(mode="before")
    @classmethod
    def _single_turn_defaults(cls, data):
        """What a record without turns (older schemas, a single-turn writer) means: one model turn
        over the whole completion, truncated when vLLM stopped it at the length limit."""
        if isinstance(data, dict) and ("model_turns" not in data or "truncated" not in data):
            data = dict(data)
            if "model_turns" not in data:
                n = len(_validate_array(data.get("completion_ids", ()), "<i4", "token ids"))
                data["model_turns"] = [ModelTurn(start=0, end=n)] if n else []
            data.setdefault("truncated", data.get("finish_reason") == "length")
        return data

    @model_validator(mode="after")
    def _aligned(self):
        _check_turns(self.model_turns, len(self.completion_ids))
        if len(self.logprobs) != self.model_length:
            raise ValueError(f"{self.model_length} model tokens but {len(self.logprobs)} log-probs.")
        for name, spans in (("version", self.versions), ("context version", self.context_versions)):
            if spans and (spans[0].start != 0 or spans[-1].end != self.model_length):
                raise ValueError(f"{name} spans {spans} do not cover the {self.model_length} model tokens.")
        if self.finish_reason == "length" and not self.truncated:
            raise ValueError("finish_reason 'length' with truncated=false: a turn cut at the length limit "
                             "truncates its trajectory; set truncated=true.")
        return self

    @property
    def length(self) -> int:
        """Completion tokens, the environment's included."""
        return len(self.completion_ids)

    @property
    def model_length(self) -> int:
        """The model's tokens (the loss's)."""
        return sum(t.end - t.start for t in self.model_turns)

    @property
    def mask(self) -> np.ndarray:
        """Per completion token: True on the model's tokens, False on the environment's."""
        out = np.zeros(self.length, dtype=bool)
        for t in self.model_turns:
            out[t.start : t.end] = True
        return out

    @property
    def first_version(self) -> int:
        """The weights of its oldest model token (the environment's tokens have none)."""
        return min(s.version for s in self.versions) if self.versions else 0

    def token_lags(self, version: int) -> np.ndarray:
        """Per model token, ``version`` minus the version that sampled it (int32, >= 0; tokens of no
        recorded version count from version 0)."""
        return np.maximum(version - _per_token(self.versions, self.model_length, fill=0), 0).astype(np.int32)

    def stale_cache(self) -> Optional[np.ndarray]:
        """Per model token, True where it was sampled over KV older than the weights that sampled
        it (``context_versions`` below ``versions``); None when no context version is recorded."""
        if not self.context_versions:
            return None
        n = self.model_length
        return _per_token(self.context_versions, n, fill=0) < _per_token(self.versions, n, fill=0)

    def fresh_start(self, version: int) -> int:
        """Index (over model tokens) of the first one sampled by ``version`` itself (``model_length``
        if none was)."""
        for span in self.versions:
            if span.version >= version:
                return span.start
        return self.model_length


def _per_token(spans: list[VersionSpan], n: int, fill: int) -> np.ndarray:
    """Each of ``n`` model tokens' version from ``spans`` (int64; ``fill`` where no span covers it)."""
    out = np.full(n, fill, dtype=np.int64)
    for span in spans:
        out[span.start : span.end] = span.version
    return out


def _check_turns(turns: list[ModelTurn], n: int) -> None:
    if (n == 0) != (not turns):
        raise ValueError(f"model turns {turns} for a completion of {n} tokens: a non-empty completion has "
                         "at least one model turn, an empty one none.")
    previous = -1
    for t in turns:
        if t.start >= t.end or t.start <= previous:
            raise ValueError(f"model turns {turns} must be non-empty, in order, with at least one environment "
                             "token between two turns (adjacent turns are one turn: merge them).")
        previous = t.end
    if turns and turns[-1].end != n:
        raise ValueError(f"the last model turn ends at {turns[-1].end}, the completion at {n}: leave out "
                         "environment tokens after the last model turn (they carry no loss).")


class GroupTimings(Record):
    submitted_at: float
    """Unix time the actor sent the group's request (set by the actor, never a default)."""
    generate_s: float = Field(ge=0.0)
    verify_s: float = Field(ge=0.0)


class RolloutGroup(Record):
    """The G rollouts of one prompt, as one record of the durable stream."""

    VERSION_FIELD: ClassVar[str] = "schema_version"
    VERSION: ClassVar[int] = SCHEMA_VERSION
    READS: ClassVar[tuple[int, ...]] = READ_SCHEMA_VERSIONS[:-1]
    MISMATCH: ClassVar[str] = "read the stream with the megatron_apriel version that wrote it."

    kind: Literal["rollout_group"] = "rollout_group"
    schema_version: int = SCHEMA_VERSION
    seq: int = Field(ge=-1)
    """Position in the stream: 0, 1, 2, ... without gaps (-1 until the stream assigns it)."""
    problem_id: str
    domain: str
    prompt_ids: TokenIds
    rollouts: list[Rollout] = Field(min_length=1)
    admitted_version: int = Field(ge=0)
    """The trainer's published weight version when the actor admitted the group."""
    dropped: Optional[Literal["zero_advantage", "verifier_error"]] = None
    """Not trained, and why: every advantage ~0 (dynamic sampling), or a verifier crashed."""
    timings: GroupTimings

    @model_validator(mode="after")
    def _routes_fit(self):
        for r in self.rollouts:
            if r.routed_experts is not None and r.routed_experts.shape[0] != len(self.prompt_ids) + r.length - 1:
                raise ValueError(f"routed experts of {r.routed_experts.shape[0]} tokens for a prompt of "
                                 f"{len(self.prompt_ids)} and a completion of {r.length} (expected prompt + "
                                 "completion - 1).")
        return self

    @property
    def min_version(self) -> int:
        """The oldest weights any of its tokens came from: the group's lag is measured from it."""
        return min(r.first_version for r in self.rollouts)

    def train_sample(self, index: int, version: int, moe_layers: Optional[Sequence[int]] = None,
                     need_routing: bool = False) -> "TrainSample":
        """Rollout ``index`` as a `TrainSample`, for a step that trains the weights of ``version``
        (its arrays are the sample's own: the record's stay read-only). ``moe_layers``: a MoE
        model's sparse layers, whose routed experts the sample then carries (if recorded;
        ``need_routing``: an error if not)."""
        r = self.rollouts[index]
        routing = None
        if moe_layers is not None and r.routed_experts is not None:
            routing = routing_rows(r.routed_experts.array(), moe_layers)
        elif need_routing:
            raise ValueError(f"group {self.seq} ({self.problem_id}) has no routed experts, which "
                             "rollout.routing_replay=true replays: serve the model with `apriel-serve "
                             "--return-routed-experts` (the launchers add it when rollout.routing_replay is on).")
        return TrainSample(np.concatenate([self.prompt_ids, r.completion_ids]), len(self.prompt_ids),
                           r.logprobs.copy(), r.advantage, truncated=r.truncated, fresh_start=r.fresh_start(version),
                           group=self.seq, lags=r.token_lags(version), server=r.server, routing=routing,
                           mask=None if r.model_length == r.length else r.mask, stale_cache=r.stale_cache())

    def train_samples(self, version: int) -> list["TrainSample"]:
        """One `TrainSample` per rollout (see `train_sample`)."""
        return [self.train_sample(i, version) for i in range(len(self.rollouts))]

"""One trajectory as token ids, turn after turn (token in, token out), and the chat template's
tokens between the turns.

    chat = ChatTokens(tokenizer)
    prompt = chat.prompt(start.messages, start.tools)                # rendered once
    t = Trajectory(len(prompt))
    t.add_turn(completion)                                           # the ids as vLLM sampled them
    env = chat.between(history, start.tools, reply.messages, completion.token_ids)
    t.add_environment(env)                                           # the reply's template ids only
    ... next request: prompt + t.ids

- The model's ids are never decoded and encoded again: the trajectory keeps them as the fleet
  returned them. Its text (decoded once) goes to the environment only.
- The environment's ids between two turns are the chat template's rendering of the reply's
  messages (and the next assistant header), tokenized alone (``ChatTokens.between``): the
  template is rendered twice as text, with a placeholder assistant turn, without then with the
  reply, and the difference is the suffix. What closes the assistant turn in the template
  (e.g. ``<|im_end|>\\n``) and the model did not sample itself is put in front of the suffix: all
  of it after a stop string, what follows the special token the model ended with (its EOS) else.
- A template is *append-only* when rendering the whole conversation gives the same text as the
  prompt, then each turn and its suffix (``append_only``, checked once on a probe conversation
  at the actor's start). One that is not (Qwen3's drops the reasoning of earlier assistant turns;
  some templates render the system prompt from the last message) still gives token-exact records:
  the ids are what the model saw when it sampled; only a full re-render would differ.
- Log-probs and version spans are per model token, across turns (spans shifted to the model
  token count and merged where one version continues); the routed experts of each position come
  from the request that first computed it: a model token's from the request that sampled it, an
  environment token's (and the last sampled token of a turn, prefilled then) from the next turn's
  request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from megatron_apriel.fleet.client import Completion
from megatron_apriel.records.rollouts import ModelTurn, RoutedExperts, VersionSpan

PLACEHOLDER = "ASSISTANT_TURN_7c1e"
"""The assistant content of the template's text renders (never in what the model sees)."""


class ChatTokens:
    """The chat template of ``tokenizer`` as a prompt and as suffixes appended after a model turn."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._special = frozenset(getattr(tokenizer, "all_special_ids", ()))

    def _render(self, messages: Sequence[dict], tools, generation: bool) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                                  add_generation_prompt=generation, tokenize=False)

    def prompt(self, messages: Sequence[dict], tools=()) -> list[int]:
        """The first messages through the template, tokenized, ready for the assistant's turn."""
        ids = self.tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                                 add_generation_prompt=True, tokenize=True, return_dict=False)
        if not ids:
            raise ValueError("the chat template rendered an empty prompt.")
        return list(ids)

    def suffix_text(self, history: Sequence[dict], tools, reply: Sequence[dict], last_ids: Sequence[int]) -> str:
        """The text the template puts after the model's sampled turn: what closes the assistant
        turn that the model did not sample (its last token ``last_ids[-1]``), the reply's messages
        and the next assistant header. ``history``: the messages before that assistant turn."""
        turn = [*history, {"role": "assistant", "content": PLACEHOLDER}]
        before = self._render(turn, tools, generation=False)
        after = self._render([*turn, *reply], tools, generation=True)
        if not after.startswith(before) or PLACEHOLDER not in before:
            raise ValueError("the chat template renders the conversation before a reply differently once the "
                             "reply follows: its suffix is not an append (see actor/trajectory.py).")
        close = before[before.rindex(PLACEHOLDER) + len(PLACEHOLDER):]
        if last_ids and last_ids[-1] in self._special:  # the model sampled the end of its turn itself
            sampled = self.tokenizer.decode([last_ids[-1]], skip_special_tokens=False)
            if sampled and close.startswith(sampled):
                close = close[len(sampled):]
        return close + after[len(before):]

    def between(self, history: Sequence[dict], tools, reply: Sequence[dict], last_ids: Sequence[int]) -> list[int]:
        """``suffix_text`` tokenized alone (the environment's ids between two model turns)."""
        ids = self.tokenizer.encode(self.suffix_text(history, tools, reply, last_ids), add_special_tokens=False)
        if not ids:
            raise ValueError("the chat template rendered an empty environment turn.")
        return list(ids)

    def append_only(self, messages: Sequence[dict], tools=()) -> Optional[str]:
        """None if rendering ``messages`` (system/user first, then assistant turns each followed by
        tool or user messages, ending on a non-assistant one) whole gives the text of the prompt,
        then each assistant turn with its close and its suffix; else where they differ."""
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        text = self._render(messages[:first], tools, generation=True)
        i = first
        while i < len(messages):
            j = i + 1
            while j < len(messages) and messages[j]["role"] != "assistant":
                j += 1
            try:
                text += messages[i]["content"] + self.suffix_text(messages[:i], tools, messages[i + 1:j], ())
            except ValueError as err:  # no suffix at all: multi-turn rollouts would fail on this template
                return str(err)
            i = j
        whole = self._render(messages, tools, generation=True)
        if text == whole:
            return None
        at = next((k for k, (a, b) in enumerate(zip(text, whole)) if a != b), min(len(text), len(whole)))
        return f"appended and whole renders differ at character {at}: {text[at:at + 60]!r} vs {whole[at:at + 60]!r}"


PROBE = ({"role": "system", "content": "You may call tools."}, {"role": "user", "content": "What is 2 + 3?"},
         {"role": "assistant", "content": "[add(a=2, b=3)]"}, {"role": "tool", "content": "5"},
         {"role": "assistant", "content": "It is 5."}, {"role": "user", "content": "And 5 + 1?"})
"""The conversation ``append_only`` is checked on at the actor's start."""


@dataclass
class Trajectory:
    """The completion of one rollout, as the turns come: ids, model turns, per-model-token
    log-probs and version spans, routed experts per position (module docstring)."""

    prompt_len: int
    ids: list[int] = field(default_factory=list)
    turns: list[ModelTurn] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[VersionSpan] = field(default_factory=list)
    context_versions: list[VersionSpan] = field(default_factory=list)
    """Per model token, the oldest weights its KV cache may hold (``Completion.context_version`` of
    its turn's request; empty when requests carry none: ``fleet.kv_on_update=recompute``)."""
    finish_reason: str = ""
    truncated: bool = False
    server: str = ""
    attempts: int = 1
    last_ids: list[int] = field(default_factory=list)
    """The last model turn's ids (empty: it sampled none)."""
    _routes: Optional[list[np.ndarray]] = field(default_factory=list)
    _routed_rows: int = 0

    @property
    def model_length(self) -> int:
        return len(self.logprobs)

    def add_turn(self, c: Completion) -> None:
        """A model turn, exactly as sampled (``c.token_ids``; ``c`` was asked with prompt + ``ids``)."""
        if self.turns and self.turns[-1].end == len(self.ids):
            raise ValueError("two model turns need environment tokens between them.")
        start, offset = len(self.ids), self.model_length
        self.ids.extend(c.token_ids)
        self.last_ids = list(c.token_ids)
        if c.token_ids:  # an empty turn (no token sampled) ends the trajectory: ``finish`` drops what follows it
            self.turns.append(ModelTurn(start=start, end=len(self.ids)))
        self.logprobs.extend(c.logprobs)
        for s in c.versions:
            _append_span(self.versions, VersionSpan(version=s.version, start=s.start + offset, end=s.end + offset))
        if c.context_version is not None and c.token_ids:
            _append_span(self.context_versions, VersionSpan(version=max(c.context_version, 0), start=offset,
                                                            end=offset + len(c.token_ids)))
        self.finish_reason = c.finish_reason
        self.truncated = self.truncated or c.finish_reason == "length"
        self.server = c.server
        self.attempts = max(self.attempts, c.attempts)
        if c.token_ids or not offset:
            self._add_routes(c)

    def _add_routes(self, c: Completion) -> None:
        if self._routes is None:
            return
        if c.routed_experts is None:
            self._routes = None
            return
        rows = self.prompt_len + len(self.ids) - 1
        array = c.routed_experts.array() if self._routes or rows != c.routed_experts.shape[0] else None
        if array is None:  # the first turn: the server's array is the record's as it is (no decode)
            self._routes.append(c.routed_experts)
        else:
            if array.shape[0] != rows:
                raise ValueError(f"{c.server} returned routed experts for {array.shape[0]} positions, expected {rows}.")
            self._routes.append(array[self._routed_rows:])
        self._routed_rows = rows

    def add_environment(self, ids: Sequence[int]) -> None:
        if not ids:
            raise ValueError("an empty environment turn.")
        self.ids.extend(ids)

    def finish(self) -> None:
        """Leave out the environment's tokens after the last model turn (they carry no loss and
        have no routes)."""
        del self.ids[self.turns[-1].end if self.turns else 0:]

    def routed_experts(self) -> Optional[RoutedExperts]:
        if not self._routes:
            return None
        if len(self._routes) == 1 and isinstance(self._routes[0], RoutedExperts):
            return self._routes[0]
        parts = [r.array() if isinstance(r, RoutedExperts) else r for r in self._routes]
        wide = max(np.dtype(p.dtype).itemsize for p in parts)
        return RoutedExperts.from_array(np.concatenate(parts).astype(np.uint8 if wide == 1 else np.uint16))

    @classmethod
    def single(cls, c: Completion, prompt_len: Optional[int] = None) -> "Trajectory":
        """A one-turn trajectory of one completion."""
        t = cls(prompt_len=len(c.prompt_token_ids) if prompt_len is None else prompt_len)
        t.add_turn(c)
        return t


def _append_span(spans: list[VersionSpan], span: VersionSpan) -> None:
    """``span`` after ``spans``, merged into the last one where the same version continues."""
    if spans and spans[-1].version == span.version and spans[-1].end == span.start:
        spans[-1] = spans[-1].model_copy(update={"end": span.end})
    else:
        spans.append(span)

"""The environment contract: a problem's first messages and tools, a step that answers each model
turn, and a score at the end.

    episode = ENVIRONMENTS[name].start(problem)     # this trajectory's own state
    messages = list(episode.first.messages)         # tools for the chat template: episode.first.tools
    while True:
        text = generate(messages)                   # one assistant turn
        reply = episode.step(text)
        if reply.done:
            break
        messages += [{"role": "assistant", "content": text}, *reply.messages]
    result = score_episode(episode)                 # a VerifierResult, as a verifier returns

- An ``Environment`` is stateless and shared: ``start`` builds an ``Episode`` that owns everything
  one trajectory changes (its tools' state), so the G rollouts of one problem never see each
  other's changes.
- ``Episode.step`` takes the text of one assistant turn and answers with a ``Reply``: tool
  results (role ``tool``, one message per call, in the order of the calls), a user's next message
  (role ``user``), or the end (``done``, no messages). Each reply's messages are appended after
  what is already there: the conversation is never re-rendered (the loop appends their template
  tokens after the model's sampled ones).
- ``Episode.score`` may be called at any time: on a trajectory the loop stopped early (turn or
  token limits) it scores what is there, as the environment's rules say (BFCL: a failure).
  ``score_episode`` is the one place that turns an environment's own crash into
  ``Outcome.VERIFIER_ERROR`` (as ``verifiers.base.run_verifier`` does for a verifier).
- A single-turn verifier is the one-step case (``single_turn.py``): it ends after the first model
  turn, and its score is the verifier's result.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Protocol

from megatron_apriel.records.rollouts import Problem
from megatron_apriel.verifiers.base import Outcome, VerifierResult, failed

Message = dict[str, str]
"""``{"role": ..., "content": str}``, as in ``Problem.prompt``."""


@dataclass(frozen=True)
class Start:
    """What the model sees before its first turn."""

    messages: tuple[Message, ...]
    """The first messages (system and user), in order."""
    tools: tuple[dict, ...] = ()
    """Tool schemas for the chat template's ``tools=`` (empty when the messages list the tools
    themselves, as BFCL's prompting format does)."""

    def __post_init__(self) -> None:
        if not self.messages:
            raise ValueError("an episode starts from at least one message.")
        _check_messages(self.messages, ("system", "user", "assistant"))


@dataclass(frozen=True)
class Reply:
    """The environment's answer to one model turn: messages to append, or the end."""

    messages: tuple[Message, ...] = ()
    done: bool = False

    def __post_init__(self) -> None:
        if self.done == bool(self.messages):
            raise ValueError("a reply either ends the episode (no messages) or continues it (messages).")
        _check_messages(self.messages, ("tool", "user"))

    @classmethod
    def end(cls) -> "Reply":
        return cls(done=True)

    @classmethod
    def tool_results(cls, results: list[str]) -> "Reply":
        return cls(messages=tuple({"role": "tool", "content": r} for r in results))


def _check_messages(messages: tuple[Message, ...], roles: tuple[str, ...]) -> None:
    for m in messages:
        if set(m) != {"role", "content"} or m["role"] not in roles or not isinstance(m["content"], str):
            raise ValueError(f"bad message {str(m)[:200]}: need exactly 'role' (one of {roles}) and a str 'content'.")


class Episode(Protocol):
    """One trajectory's live state. ``step`` after the end is a bug of the caller (it raises)."""

    first: Start

    def step(self, text: str) -> Reply: ...

    def score(self) -> VerifierResult: ...


class Environment(Protocol):
    """A kind of task; ``start`` must not share mutable state between the episodes it builds."""

    name: str

    def start(self, problem: Problem) -> Episode: ...


def score_episode(episode: Episode) -> VerifierResult:
    """``episode.score()``, with a crash of the environment's own code as VERIFIER_ERROR (never a
    model failure); the traceback's last lines go into ``detail``."""
    try:
        return episode.score()
    except Exception as err:  # the one boundary, as in verifiers.base.run_verifier
        tail = "".join(traceback.format_exception(err)[-3:])
        return failed(Outcome.VERIFIER_ERROR, f"{type(err).__name__}: {err}\n{tail}"[:2000])

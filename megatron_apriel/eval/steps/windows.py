"""Long traces: cut into windows the judge can take, at step-safe boundaries, or refused.

A trace longer than ``max_chars`` is cut only where a step may end: at a paragraph break, or,
inside a paragraph longer than the window, at a sentence end (the offline segmenter's
boundaries, `offline.paragraphs` / `offline.sentences`). Consecutive pieces are packed greedily
into windows of at most ``max_chars``; each window is judged on its own and the trace's steps are
the windows' steps in order. So a step never spans two windows: where the judge would have made
one step across a window boundary, two steps are counted (at most windows - 1 extra steps per
trace; the report counts the windowed traces). A trace with a sentence longer than ``max_chars``
(no step-safe boundary to cut at) is refused with that reason, and counted as failed.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_apriel.eval.steps.offline import pack, paragraphs, sentences


@dataclass(frozen=True)
class Refusal:
    reason: str


def split_windows(text: str, max_chars: int) -> list[str] | Refusal:
    """``text`` as one window, or as several (joined, they are ``text``), or a `Refusal`."""
    if max_chars < 1:
        raise ValueError(f"the window must hold at least 1 character, got {max_chars}.")
    if len(text) <= max_chars:
        return [text]
    units: list[str] = []
    for paragraph in paragraphs(text):
        units += sentences(paragraph) if len(paragraph) > max_chars else [paragraph]
    longest = max(units, key=len)
    if len(longest) > max_chars:
        at = text.find(longest)
        return Refusal(f"too long for one judge window ({len(text)} characters, window {max_chars}) and no step-safe "
                       f"boundary to cut at: characters {at}-{at + len(longest)} hold no paragraph break or sentence "
                       "end (raise --window-chars if the judge's context allows)")
    return pack(units, max_chars)

"""The offline baseline: a rule-based segmenter that needs no judge (it labels nothing).

Rules, applied in order; every step is a verbatim slice and the steps, joined, are the trace:

1. The recipe's answer block, from the last ``[BEGIN FINAL RESPONSE]`` to the end of the trace,
   is one step (the final answer); the text before it is the reasoning.
2. The reasoning is cut into paragraphs after each blank line (a line break, optional spaces or
   tabs, another line break, and any whitespace that follows: it stays with the paragraph above).
3. A paragraph longer than ``max_step_chars`` is cut into sentences (after ``.``, ``!`` or ``?``
   followed by whitespace, and after each line break), packed greedily into steps of at most
   ``max_step_chars``; one sentence longer than that is a step of its own.
4. A piece that is whitespace only joins the step before it (the next one, at the start).

The same paragraph and sentence boundaries are where `windows.split_windows` may cut a long trace.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megatron_apriel.verifiers.base import BEGIN_FINAL

SEGMENTER_NAME = "offline-rules-v1"
_PARAGRAPH_END = re.compile(r"\n[ \t]*\n\s*")
_SENTENCE_END = re.compile(r"[.!?]\s+|\n")


@dataclass(frozen=True)
class OfflineConfig:
    max_step_chars: int = 800
    """A paragraph longer than this is cut at sentence boundaries (rule 3)."""

    def __post_init__(self) -> None:
        if self.max_step_chars < 1:
            raise ValueError(f"max_step_chars must be >= 1, got {self.max_step_chars}.")


def _cut_after(text: str, pattern: re.Pattern) -> list[str]:
    """``text`` cut after every match of ``pattern`` (verbatim pieces, none empty)."""
    pieces, start = [], 0
    for match in pattern.finditer(text):
        if match.end() < len(text):
            pieces.append(text[start:match.end()])
            start = match.end()
    pieces.append(text[start:])
    return [p for p in pieces if p]


def paragraphs(text: str) -> list[str]:
    return _cut_after(text, _PARAGRAPH_END)


def sentences(text: str) -> list[str]:
    return _cut_after(text, _SENTENCE_END)


def pack(units: list[str], limit: int) -> list[str]:
    """Consecutive ``units`` joined greedily into pieces of at most ``limit`` characters (a unit
    longer than ``limit`` is a piece of its own)."""
    out: list[str] = []
    for unit in units:
        if out and len(out[-1]) + len(unit) <= limit:
            out[-1] += unit
        else:
            out.append(unit)
    return out


def merge_blank(pieces: list[str]) -> list[str]:
    """Rule 4: whitespace-only pieces joined to their neighbour."""
    out: list[str] = []
    for piece in pieces:
        if out and (not piece.strip() or not out[-1].strip()):
            out[-1] += piece
        else:
            out.append(piece)
    return out


def split_answer(text: str) -> tuple[str, str]:
    """(reasoning, answer block): rule 1; the answer block is empty when there is no marker."""
    at = text.rfind(BEGIN_FINAL)
    return (text, "") if at < 0 else (text[:at], text[at:])


def segment(text: str, cfg: OfflineConfig = OfflineConfig()) -> list[str]:
    """The steps of ``text`` by rules 1-4; ``"".join(segment(t)) == t``, and ``[]`` for ``""``."""
    reasoning, answer = split_answer(text)
    pieces: list[str] = []
    for paragraph in paragraphs(reasoning):
        pieces += pack(sentences(paragraph), cfg.max_step_chars) if len(paragraph) > cfg.max_step_chars \
            else [paragraph]
    if answer:
        pieces.append(answer)
    return merge_blank(pieces)

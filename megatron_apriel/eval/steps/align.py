"""Where a judge's steps fall in the trace: cut positions, found with whitespace forgiven.

Both answer modes end the same way, in a list of cut positions in the window: the accepted steps
are ``window[cut_i:cut_i+1]``, the trace's own characters, so they join to it exactly by
construction, whatever whitespace the judge wrote. A step begins at its first character other
than whitespace; the whitespace before it ends the step before (the first step starts the trace).

- copy (`align_texts`): the judge's step texts, whitespace removed, must be the trace's characters
  other than whitespace, in order, every one. Otherwise the first character missing, added or
  changed is named.
- boundaries (`find_starts`): each step's quoted start (whitespace aside) is looked for after the
  previous step's start, beginning a word; the first step's start must begin the trace. A start
  not found is refused, and so is an ambiguous one: found more than once before the next step's
  start (or the end, for the last step). A start ending in ``...`` may be cut short there.

Both return the cuts, or a string saying what is wrong (the judge is shown it).
"""

from __future__ import annotations

_ELLIPSES = ("...", "\u2026")


def _dense(text: str) -> tuple[str, list[int]]:
    """``text`` without its whitespace, and the index in ``text`` of each character kept."""
    at = [i for i, c in enumerate(text) if not c.isspace()]
    return "".join(text[i] for i in at), at


def _excerpt(text: str, start: int) -> str:
    return repr(text[start:start + 30])


def align_texts(texts: list[str], window: str) -> list[int] | str:
    """The cuts of ``window`` at the judge's step ``texts``, or where they first differ from it."""
    dense_w, at_w = _dense(window)
    cuts, pos = [], 0
    for i, text in enumerate(texts):
        dense_t, at_t = _dense(text)
        if not dense_t:
            return f"step {i} holds only whitespace: join it to the step before or after it"
        cuts.append(pos)
        got = dense_w[pos:pos + len(dense_t)]
        k = next((j for j, (x, y) in enumerate(zip(got, dense_t)) if x != y), min(len(got), len(dense_t)))
        if k < len(dense_t):
            if pos + k == len(dense_w):
                return (f"the steps joined go on after the trace ends (whitespace aside): step {i} adds "
                        f"{_excerpt(text, at_t[k])}")
            x = at_w[pos + k]
            return (f"the steps joined differ from the trace other than in whitespace at trace character {x}: "
                    f"trace {_excerpt(window, x)}, step {i} {_excerpt(text, at_t[k])}")
        pos += len(dense_t)
    if pos < len(dense_w):
        x = at_w[pos]
        return (f"the steps joined end at trace character {x}, before the trace does: it goes on with "
                f"{_excerpt(window, x)}")
    return [0] + [at_w[c] for c in cuts[1:]]


def _starts_word(window: str, i: int) -> bool:
    return i == 0 or not (window[i - 1].isalnum() and window[i].isalnum())


def _hits(dense_w: str, at_w: list[int], window: str, needle: str, lo: int, hi: int) -> list[int]:
    """Dense positions in [lo, hi) where ``needle`` begins, at the start of a word of ``window``."""
    out, p = [], dense_w.find(needle, lo)
    while 0 <= p < hi:
        if _starts_word(window, at_w[p]):
            out.append(p)
        p = dense_w.find(needle, p + 1)
    return out


def _needles(start: str) -> list[str]:
    """The start without whitespace, and without a trailing ellipsis (tried only if the first fails)."""
    dense = "".join(start.split())
    cut = next((dense[:-len(e)] for e in _ELLIPSES if dense.endswith(e) and len(dense) > len(e)), None)
    return [dense] + ([cut] if cut else [])


def find_starts(starts: list[str], window: str) -> list[int] | str:
    """The cuts of ``window`` at the judge's quoted step ``starts``, or why one is missing or ambiguous."""
    dense_w, at_w = _dense(window)
    needles = [_needles(s) for s in starts]

    def hits(i: int, lo: int) -> list[int]:
        """Where step i's start may begin from dense position ``lo`` on (its first needle that occurs)."""
        return next((h for n in needles[i] if (h := _hits(dense_w, at_w, window, n, lo, len(dense_w)))), [])

    empty = [i for i, n in enumerate(needles) if not n[0]]
    if empty:
        return f"step {empty[0]} has an empty start: quote its first words"
    if not any(dense_w.startswith(n) for n in needles[0]):
        return (f"step 0's start {starts[0]!r} is not how the trace begins ({_excerpt(window, at_w[0] if at_w else 0)})"
                ": the first step starts the trace")
    positions = [0]
    for i in range(1, len(starts)):
        found = hits(i, positions[-1] + 1)
        if not found:
            return (f"step {i}'s start {starts[i]!r} is not in the trace after step {i - 1}'s start (trace character "
                    f"{at_w[positions[-1]]}): quote the first words of each step exactly, in order")
        nxt = (hits(i + 1, found[0] + 1) or [len(dense_w)])[0] if i + 1 < len(starts) else len(dense_w)
        before = [h for h in found if h < nxt]
        if len(before) > 1:
            where = ", ".join(str(at_w[h]) for h in before[:5])
            return (f"step {i}'s start {starts[i]!r} is ambiguous: it occurs {len(before)} times after step {i - 1}'s "
                    f"start and before the next step's (at trace characters {where}); quote more of its words")
        positions.append(found[0])
    return [0] + [at_w[p] for p in positions[1:]]

"""How every command refuses bad input: one line on stderr (``<command>: error: <what and the fix>``),
exit code 2, no traceback. ``APRIEL_DEBUG=1`` re-raises the error instead, with its traceback, in
every command and in the launcher.

What counts as bad input: `REFUSALS`, raised by configs, checks and readers with a message that
names the key, preset or file and says how to fix it. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Callable, Iterator, NoReturn

REFUSALS: tuple[type[Exception], ...] = (ValueError, FileNotFoundError)
DEBUG_ENV = "APRIEL_DEBUG"


def debugging() -> bool:
    return os.environ.get(DEBUG_ENV) == "1"


def refuse(prog: str, err: Exception | str, after: str = "") -> NoReturn:
    """``prog: error: err`` (then ``after``, e.g. what was kept) on stderr and exit code 2; with
    ``APRIEL_DEBUG=1`` an exception is raised again instead, traceback and all."""
    if isinstance(err, BaseException) and debugging():
        raise err
    print(f"{prog}: error: {err}{after}", file=sys.stderr)
    raise SystemExit(2)


@contextmanager
def refusals(prog: str, kinds: tuple[type[Exception], ...] = REFUSALS,
             after: Callable[[], str] = lambda: "") -> Iterator[None]:
    """Turn ``kinds`` raised in the block into `refuse` (``after()`` is appended to the line)."""
    try:
        yield
    except kinds as err:
        refuse(prog, err, after())

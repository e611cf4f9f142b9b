"""LiveCodeBench test cases, decoded from the released jsonl files without trusting their pickles.

The released ``private_test_cases`` field is base64 of zlib-compressed *pickled* JSON text.
Unpickling downloaded data can run arbitrary code, so `decode_test_cases` unpickles with
`PlainUnpickler`, which refuses every global (class, function) a pickle may name: only the
pickle opcodes for plain values (str, bytes, int, float, bool, None, list, tuple, dict) work, and
anything else raises a ValueError that says so. Plain JSON text (as in ``public_test_cases``) is
read as JSON directly.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import pickle
import zlib
from typing import Any


class PlainUnpickler(pickle.Unpickler):
    """An unpickler for plain values only: any reference to a class or function is refused."""

    def find_class(self, module: str, name: str):  # noqa: D401 - pickle's hook
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: only plain values (str, list, dict, ...) "
                                     "are accepted in LiveCodeBench test cases")


def _unpickle_plain(data: bytes) -> Any:
    return PlainUnpickler(io.BytesIO(data)).load()


def decode_test_cases(field: str) -> list[dict[str, Any]]:
    """The list of ``{"input", "output", "testtype"}`` dicts in a ``*_test_cases`` field: JSON text,
    or base64(zlib(pickle(JSON text))). Raises ValueError naming what failed."""
    if not isinstance(field, str):
        raise ValueError(f"test cases must be text, got {type(field).__name__}")
    try:
        value = json.loads(field)
    except json.JSONDecodeError:
        try:
            raw = zlib.decompress(base64.b64decode(field, validate=False))
        except (binascii.Error, zlib.error) as err:
            raise ValueError(f"test cases are neither JSON nor base64(zlib(pickle)) ({err})") from err
        try:
            text = _unpickle_plain(raw)
        except (pickle.UnpicklingError, EOFError, ValueError) as err:
            raise ValueError(f"compressed test cases: {err}") from err
        if not isinstance(text, (str, bytes)):
            raise ValueError(f"compressed test cases hold a {type(text).__name__}, expected JSON text")
        value = json.loads(text)
    if not isinstance(value, list) or not all(isinstance(t, dict) and {"input", "output"} <= set(t) for t in value):
        raise ValueError("test cases must be a list of objects with 'input' and 'output'")
    return value


def to_verifier_tests(cases: list[dict[str, Any]], functional: bool) -> list[dict[str, Any]]:
    """Our code verifier's tests (`verifiers/code.py`): stdin text and expected stdout, or, for
    functional problems, the positional arguments (one JSON value per input line) and the JSON
    return value."""
    tests = []
    for case in cases:
        kind = case.get("testtype", "functional" if functional else "stdin")
        if (kind == "functional") != functional:
            raise ValueError(f"a {kind!r} test in a {'functional' if functional else 'stdin'} problem")
        if functional:
            args = [json.loads(line) for line in case["input"].split("\n") if line.strip()]
            tests.append({"input": args, "output": json.loads(case["output"])})
        else:
            tests.append({"input": case["input"], "output": case["output"]})
    return tests

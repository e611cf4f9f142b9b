"""Tool calls are data: the model's text is parsed into function names and literal arguments,
never evaluated.

The model writes its calls in the final response of its turn (after the reasoning; see
``verifiers.base.extract_final_response``), in either form:

- BFCL's Python list, the format its prompting mode asks for: ``[cd(folder='docs'), ls()]``
  (a single call may go without the brackets). The text is parsed with ``ast``; each element
  must be a call of a plain name, and each argument a literal (``ast.literal_eval`` of that
  argument's node alone: strings, numbers, booleans, None, and lists, tuples, dicts and sets of
  them). Positional arguments are passed on (BFCL's own ground truth uses them:
  ``sort('final_report.pdf')``).
- The recipe's chat-template block ``<tool_calls>[{"name": ..., "arguments": {...}}]</tool_calls>``
  (JSON, read by ``verifiers.function_calling.parse_tool_calls``).

``parse_calls`` returns None when the answer holds no call: that ends the turn's tool loop (BFCL:
a response that does not decode into calls ends the turn). Otherwise one entry per call, in
order: a ``Call``, or a ``BadCall`` that the environment answers with an error message in the
tool turn (attribute chains such as ``__import__('os').system(...)``, underscore names, ``**``
or ``*`` arguments, non-literal arguments such as ``lambda: 0`` or ``x.__class__``). What a
``Call`` may reach is the environment's business: a public method of its own tool instances.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from typing import Any

from megatron_apriel.verifiers.base import extract_final_response, strip_reasoning
from megatron_apriel.verifiers.function_calling import ToolCallParseError, parse_tool_calls

ERROR_PREFIX = "Error during execution: "
"""How BFCL's executor begins the tool answer of a call that failed (``multi_turn_utils``)."""

_LITERAL_ERRORS = (ValueError, TypeError, SyntaxError, MemoryError, RecursionError)


@dataclass(frozen=True)
class Call:
    """A parsed call: a plain function name and literal arguments."""

    name: str
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BadCall:
    """A call that is not allowed or not readable; ``error`` is what the model is told."""

    source: str
    error: str


def parse_calls(text: str) -> list[Call | BadCall] | None:
    """The calls of one assistant turn (module docstring); None when it makes none."""
    answer = extract_final_response(strip_reasoning(text))
    if "<tool_calls>" in answer:
        return _json_calls(answer)
    return _python_calls(answer)


def _json_calls(answer: str) -> list[Call | BadCall] | None:
    try:
        calls = parse_tool_calls(answer)
    except ToolCallParseError as err:
        return [BadCall(answer[:200], f"the <tool_calls> block cannot be read: {err}")]
    if not calls:
        return None
    out = []
    for name, args in calls:
        call = _checked_name(Call(name, (), args))
        out.append(BadCall(name[:200], call) if isinstance(call, str) else call)
    return out


def _python_calls(answer: str) -> list[Call | BadCall] | None:
    body = answer.strip("`\n ")  # BFCL's decoder: strip code fences, then wrap in brackets
    if not body:
        return None
    body = ("" if body.startswith("[") else "[") + body + ("" if body.endswith("]") else "]")
    try:
        tree = ast.parse(body, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree.body, ast.List) or not any(isinstance(e, ast.Call) for e in tree.body.elts):
        return None
    return [_call(node, body) for node in tree.body.elts]


def _call(node: ast.expr, body: str) -> Call | BadCall:
    call = _read_call(node)
    if isinstance(call, str):
        return BadCall(_source(body, node), call)
    return call


def _source(body: str, node: ast.expr) -> str:
    return (ast.get_source_segment(body, node) or "")[:200]


def _read_call(node: ast.expr) -> Call | str:
    """The call, or why it is not allowed."""
    if not isinstance(node, ast.Call):
        return "this element is not a function call"
    if not isinstance(node.func, ast.Name):
        return "only a function's plain name may be called, not an attribute, a subscript or a call's result"
    args = []
    for i, arg in enumerate(node.args):
        if isinstance(arg, ast.Starred):
            return f"{node.func.id}: *arguments are not allowed"
        value = _literal(arg)
        if value is _NOT_LITERAL:
            return f"{node.func.id}: positional argument {i} is not a literal value"
        args.append(value)
    kwargs = {}
    for kw in node.keywords:
        if kw.arg is None:
            return f"{node.func.id}: **arguments are not allowed"
        value = _literal(kw.value)
        if value is _NOT_LITERAL:
            return f"{node.func.id}: argument {kw.arg!r} is not a literal value"
        kwargs[kw.arg] = value
    return _checked_name(Call(node.func.id, tuple(args), kwargs))


_NOT_LITERAL = object()


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except _LITERAL_ERRORS:
        return _NOT_LITERAL


def _checked_name(call: Call) -> Call | str:
    if not call.name.isidentifier() or call.name.startswith("_"):
        return f"{call.name[:100]!r} cannot be called: only public functions can"
    return call


def result_text(value: Any) -> str:
    """A tool's return value as its answer, as BFCL's executor writes it: a str as it is, a dict as
    JSON (``str`` if that fails), anything else by ``str``."""
    if type(value) is str:
        return value
    if type(value) is dict:
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            return str(value)
    return str(value)

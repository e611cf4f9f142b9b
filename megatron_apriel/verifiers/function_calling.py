"""Function-calling verifier with the semantics of BFCL's AST checker.

Reference (a BFCL v4 `possible_answer` row plus the tool schemas of its question)::

    {"ground_truth": [{"get_weather": {"city": ["Paris", "paris"], "unit": ["celsius", ""]}}],
     "functions": [{"name": "get_weather", "parameters": {"type": "dict",
                    "properties": {"city": {"type": "string"}, ...}, "required": ["city"]}}]}

Each gold call maps every parameter to its allowed values; "" among them means the parameter may
be left out. A predicted call matches a gold call when
1. the function name is equal;
2. it gives every parameter the schema requires and every gold parameter whose allowed values
   lack "" (BFCL rejects `prime_factorize(number=60)` for simple_python_23, whose gold asks for
   `return_type="dictionary"` although the schema has a default);
3. it gives no parameter outside the gold call, nor outside the schema's properties;
4. each value is allowed (`param_allowed`): it has the type the schema declares (an int passes for
   a float) or the type of the gold's values (BFCL's "variable" case: `"dontcare"` for an integer,
   null where the gold lists null, as in parallel_152); strings of a declared string type compare
   after BFCL's standardisation (lower case; spaces and `,./-_*^` removed), lists element by
   element, dicts key by key; a value of another type than declared must be listed exactly.
   An explicit "" for a string parameter (`[]` for a list one) that may be left out counts as
   leaving it out, as in BFCL.
Without a schema, (2) uses the gold's "" markers only and values compare on the gold's own types.

Calls are read from the last `<tool_calls>[...]</tool_calls>` block of the final response, or
from an OpenAI-style assistant message (`{"tool_calls": [{"function": {"name", "arguments"}}]}`)
passed as the completion. Gold and predicted calls are matched one to one, in any order, by a
maximum bipartite matching; score = matched / max(#gold, #predicted) (spraying extra calls does
not pay), success iff all gold calls are matched and nothing else was called.

Where we differ from BFCL on purpose:
- BFCL matches parallel calls greedily (each gold call takes the first unused call that fits) and
  so rejects valid answers: in parallel_178 the first gold call allows Microsoft or Apple on
  2022-01-01; given Apple's call first, it takes it and Apple's own gold call is left unmatched.
  The maximum matching accepts every order. BFCL also scores 0/1; we give partial credit.
- Within lists an int passes for a float, as it does for a plain float parameter (BFCL's nested
  type check rejects `[1, 3.0]` for `[1.0, 3.0]` unless the parameter may be left out).
A problem that no call can pass (`unpassable_reason`) raises ValueError: it is broken data, not a
model failure. BFCL v4 has four in its AST categories: live_multiple_862-181-3 and
live_multiple_964-207-0 (a gold parameter the schema lacks), live_simple_106-63-0 and
live_simple_112-68-0 (a gold parameter with an empty list of allowed values).
"""

from __future__ import annotations

import json
import re
from typing import Any

from megatron_apriel.records.rollouts import Problem
from megatron_apriel.verifiers.base import (
    Outcome,
    VerifierResult,
    correct,
    extract_final_response,
    failed,
    strip_reasoning,
)

_TOOL_CALLS = re.compile(r"<tool_calls>(.*?)</tool_calls>", re.DOTALL)
_STANDARDISE = re.compile(r"[ ,./\-_*^]")
_DECLARED_TYPES = {"string": str, "any": str, "integer": int, "float": float, "number": float,
                   "boolean": bool, "array": list, "tuple": list, "dict": dict, "object": dict}
"""Schema type names (BFCL's and JSON Schema's) to the Python type of a JSON value."""

Call = tuple[str, dict[str, Any]]


class ToolCallParseError(ValueError):
    """The model's tool calls are not valid JSON of the expected shape."""


def _to_call(item: Any) -> Call:
    if isinstance(item, dict) and "function" in item and isinstance(item["function"], dict):
        item = item["function"]  # OpenAI layout
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise ToolCallParseError(f"a call needs a string 'name': {str(item)[:200]}")
    args = item.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as err:
            raise ToolCallParseError(f"arguments of {item['name']} are not JSON: {err}") from err
    if not isinstance(args, dict):
        raise ToolCallParseError(f"arguments of {item['name']} must be an object")
    return item["name"], args


def parse_tool_calls(completion: str | dict) -> list[Call] | None:
    """The predicted calls; None when the completion contains no tool calls at all."""
    if isinstance(completion, dict):
        items = completion.get("tool_calls")
        return None if not items else [_to_call(i) for i in items]
    blocks = _TOOL_CALLS.findall(extract_final_response(strip_reasoning(completion)))
    if not blocks:
        return None
    try:
        items = json.loads(blocks[-1])
    except json.JSONDecodeError as err:
        raise ToolCallParseError(f"<tool_calls> is not JSON: {err}") from err
    if isinstance(items, dict):
        items = [items]
    if not isinstance(items, list):
        raise ToolCallParseError("<tool_calls> must hold a JSON list of calls")
    return [_to_call(i) for i in items]


def _standardise(s: str) -> str:
    return _STANDARDISE.sub("", s.lower()).replace("'", '"')


def value_allowed(value: Any, allowed: Any) -> bool:
    """Equality of one value with one allowed value, on the allowed value's type.

    bool only equals bool; an int equals a float of the same value; strings compare standardised;
    lists element by element; a dict's allowed value maps each key to its allowed values ("" among
    them: the key may be left out); null only equals null.
    """
    if isinstance(allowed, bool) or isinstance(value, bool):
        return type(value) is type(allowed) and value == allowed
    if isinstance(allowed, (int, float)) and isinstance(value, (int, float)):
        return (isinstance(allowed, float) or isinstance(value, int)) and value == allowed
    if isinstance(allowed, str) and isinstance(value, str):
        return _standardise(value) == _standardise(allowed)
    if isinstance(allowed, list) and isinstance(value, list):
        return len(value) == len(allowed) and all(value_allowed(v, a) for v, a in zip(value, allowed))
    if isinstance(allowed, dict) and isinstance(value, dict):
        options = {k: opts if isinstance(opts, list) else [opts] for k, opts in allowed.items()}
        return (value.keys() <= options.keys()
                and all(any(value_allowed(v, o) for o in options[k]) for k, v in value.items())
                and all(k in value for k, opts in options.items() if "" not in opts))
    return value is None and allowed is None


def param_allowed(value: Any, options: list, declared: type | None) -> bool:
    """Whether `value` is one of a gold parameter's `options`, given the schema's declared type."""
    if declared is None:  # no schema type: compare on each option's own type
        return any(value_allowed(value, o) for o in options)
    gold_type = next((type(o) for o in options if o != ""), None)
    typed = type(value) is declared or (declared is float and type(value) is int)
    if typed and gold_type in (None, declared):
        if value == [] and "" in options:  # an empty list stands for a left-out one, as "" does
            return True
        return any(value_allowed(value, o) for o in options)
    if typed or type(value) is gold_type:  # gold values are not of the declared type: exact match
        return value in options
    return False


def _declared_type(properties: dict, param: str) -> type | None:
    kind = properties.get(param, {}).get("type")
    return _DECLARED_TYPES.get(kind) if isinstance(kind, str) else None


def call_matches(pred: Call, gold: dict[str, dict[str, list]], schema: dict | None) -> bool:
    """Rules 1-4 of the module docstring; `schema` is the tool's entry in `functions`, or None."""
    (gold_name, options), = gold.items()
    name, args = pred
    params = (schema or {}).get("parameters", {})
    properties = params.get("properties")
    if name != gold_name or not set(args) <= set(options):
        return False
    if properties is not None and not set(args) <= set(properties):
        return False
    must = set(params.get("required", [])) | {p for p, allowed in options.items() if "" not in allowed}
    if not must <= set(args):
        return False
    return all(param_allowed(v, options[p], _declared_type(properties or {}, p)) for p, v in args.items())


def unpassable_reason(ground_truth: list[dict], functions: list[dict]) -> str | None:
    """Why no call at all can match some gold call of this reference; None when one can.

    Broken items have a gold call whose function is not among `functions`, or a gold parameter
    with an empty list of allowed values, or one that may not be left out although the schema
    does not declare it, or a schema-required parameter that the gold call does not list.
    """
    schemas = {f["name"]: f.get("parameters", {}) for f in functions}
    for gold in ground_truth:
        (name, options), = gold.items()
        if name not in schemas:
            if schemas:
                return f"gold function {name!r} is not among the tools"
            continue  # no schemas at all: the gold alone decides
        properties = schemas[name].get("properties")
        for param, allowed in options.items():
            if not allowed:
                return f"{name}: gold parameter {param!r} has no allowed value (an empty list)"
            if properties is not None and param not in properties and "" not in allowed:
                return f"{name}: gold parameter {param!r} cannot be left out but the schema does not declare it"
        for param in schemas[name].get("required", []):
            if param not in options:
                return f"{name}: the schema requires {param!r} but the gold call does not allow it"
    return None


def match_calls(preds: list[Call], golds: list[dict], functions: list[dict]) -> dict[int, int]:
    """A maximum one-to-one matching {gold index: predicted index} (augmenting paths)."""
    schemas = {f["name"]: f for f in functions}
    edges = [[j for j, g in enumerate(golds) if call_matches(p, g, schemas.get(next(iter(g))))]
             for p in preds]
    owner: dict[int, int] = {}

    def augment(i: int, seen: set[int]) -> bool:
        for j in edges[i]:
            if j not in seen:
                seen.add(j)
                if j not in owner or augment(owner[j], seen):
                    owner[j] = i
                    return True
        return False
    for i in range(len(preds)):
        augment(i, set())
    return owner


class FunctionCallingVerifier:
    domain = "function_calling"

    def verify(self, problem: Problem, completion: str | dict) -> VerifierResult:
        ref = problem.reference
        golds = ref.get("ground_truth") if isinstance(ref, dict) else None
        if not golds or any(not isinstance(g, dict) or len(g) != 1 for g in golds):
            raise ValueError(f"function_calling problem {problem.id}: 'ground_truth' must be a non-empty "
                             "list of {function_name: {param: [allowed values]}}.")
        functions = ref.get("functions", [])
        broken = unpassable_reason(golds, functions)
        if broken:
            raise ValueError(f"function_calling problem {problem.id}: no call can pass it ({broken}); "
                             "fix or drop the item (tools/prepare_data.py skips such BFCL rows).")
        try:
            preds = parse_tool_calls(completion)
        except ToolCallParseError as err:
            return failed(Outcome.UNPARSABLE, str(err))
        if preds is None:
            return failed(Outcome.NO_ANSWER, "no tool calls")
        matched = len(match_calls(preds, golds, functions))
        score = matched / max(len(golds), len(preds))
        detail = f"{matched}/{len(golds)} gold calls matched, {len(preds)} predicted"
        if matched == len(golds) == len(preds):
            return correct(detail)
        return failed(Outcome.WRONG, detail, score=score)

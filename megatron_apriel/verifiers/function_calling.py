"""Function-calling verifier with BFCL AST-checker semantics.

Reference (BFCL `possible_answer` layout plus the tool schemas)::

    {"ground_truth": [{"get_weather": {"city": ["Paris", "paris"], "unit": ["celsius", ""]}}],
     "functions": [{"name": "get_weather", "parameters": {"type": "object",
                    "properties": {...}, "required": ["city"]}}]}

Each gold call maps every parameter to its allowed values; "" among them means the parameter may
be omitted. A predicted call matches a gold call when the function name is equal, every required
parameter is present (from the schema's `required`, else every parameter whose allowed values lack
""), no parameter outside the gold call is given, and each value is allowed. Strings compare after
BFCL's standardisation (lower case; spaces and `,./-_*^` removed); an int is accepted for a float.

Calls are read from the last `<tool_calls>[...]</tool_calls>` block of the final response, or
from an OpenAI-style assistant message (`{"tool_calls": [{"function": {"name", "arguments"}}]}`)
passed as the completion. Gold and predicted calls are matched one to one, in any order; score =
matched / max(#gold, #predicted) (so that spraying extra calls does not pay), success iff all
gold calls are matched and nothing else was called.
"""

from __future__ import annotations

import json
import re
from typing import Any

from megatron_apriel.rollout.types import Problem
from megatron_apriel.verifiers.base import (Outcome, VerifierResult, correct, extract_final_response,
                                            failed, strip_reasoning)

_TOOL_CALLS = re.compile(r"<tool_calls>(.*?)</tool_calls>", re.DOTALL)
_STANDARDISE = re.compile(r"[ ,./\-_*^]")

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
    """BFCL-style equality of one predicted value with one allowed value."""
    if isinstance(allowed, bool) or isinstance(value, bool):
        return type(value) is type(allowed) and value == allowed
    if isinstance(allowed, float) and isinstance(value, (int, float)):
        return float(value) == allowed
    if isinstance(allowed, int) and isinstance(value, int):
        return value == allowed
    if isinstance(allowed, str) and isinstance(value, str):
        return _standardise(value) == _standardise(allowed)
    if isinstance(allowed, list) and isinstance(value, list):
        return len(value) == len(allowed) and all(value_allowed(v, a) for v, a in zip(value, allowed))
    if isinstance(allowed, dict) and isinstance(value, dict):
        # BFCL nests allowed-value lists inside dict parameters.
        return value.keys() <= allowed.keys() and all(
            _any_allowed(value[k], allowed[k]) if isinstance(allowed[k], list) else value_allowed(value[k], allowed[k])
            for k in value) and all(k in value for k, opts in allowed.items()
                                    if not (isinstance(opts, list) and "" in opts))
    return False


def _any_allowed(value: Any, options: list) -> bool:
    return any(value_allowed(value, o) for o in options if o != "")


def call_matches(pred: Call, gold: dict[str, dict[str, list]], required: set[str] | None) -> bool:
    (gold_name, gold_args), = gold.items()
    name, args = pred
    if name != gold_name or not set(args) <= set(gold_args):
        return False
    if required is None:
        required = {p for p, options in gold_args.items() if "" not in options}
    if not required <= set(args):
        return False
    return all(_any_allowed(value, gold_args[p]) for p, value in args.items())


def _max_matching(preds: list[Call], golds: list[dict], required: dict[str, set[str]]) -> int:
    """Size of a maximum one-to-one matching between predicted and gold calls (augmenting paths)."""
    edges = [[j for j, g in enumerate(golds) if call_matches(p, g, required.get(next(iter(g))))]
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
    return sum(augment(i, set()) for i in range(len(preds)))


class FunctionCallingVerifier:
    domain = "function_calling"

    def verify(self, problem: Problem, completion: str | dict) -> VerifierResult:
        ref = problem.reference
        golds = ref.get("ground_truth") if isinstance(ref, dict) else None
        if not golds or any(not isinstance(g, dict) or len(g) != 1 for g in golds):
            raise ValueError(f"function_calling problem {problem.id}: 'ground_truth' must be a non-empty "
                             "list of {function_name: {param: [allowed values]}}.")
        required = {f["name"]: set(f.get("parameters", {}).get("required", []))
                    for f in ref.get("functions", [])}
        try:
            preds = parse_tool_calls(completion)
        except ToolCallParseError as err:
            return failed(Outcome.UNPARSABLE, str(err))
        if preds is None:
            return failed(Outcome.NO_ANSWER, "no tool calls")
        matched = _max_matching(preds, golds, required)
        score = matched / max(len(golds), len(preds))
        detail = f"{matched}/{len(golds)} gold calls matched, {len(preds)} predicted"
        if matched == len(golds) == len(preds):
            return correct(detail)
        return failed(Outcome.WRONG, detail, score=score)

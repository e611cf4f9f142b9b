"""Our function-calling verifier against BFCL's own AST checker, on the real BFCL v4 data.

The `bfcl-eval` wheel (pinned in BFCL_VERSION) ships both the BFCL v4 files (questions with their
tool schemas under `bfcl_eval/data/`, gold answers under `data/possible_answer/`) and the checker
the leaderboard runs (`bfcl_eval/eval_checker/ast_eval/ast_checker.py`). For every problem of the
six AST categories we build predictions, gold answers written several ways (GOLD_KINDS) and
mutations of them, and ask both checkers. Install the wheel without its dependencies: they pin
numpy 1.26 and pull sentence-transformers, faiss and a dozen API clients, none of which the AST
checker needs (tools/setup_cpu_env.sh does this)::

    pip install --no-deps bfcl-eval==2026.3.23
    python -m tests.unit.verifiers.bfcl_agreement        # the agreement table, per category and per kind

Disagreements the report keeps apart (see the verifier's docstring for why ours are right):
- `greedy`: we accept, BFCL rejects, and BFCL accepts the same calls once they are put in the
  order of the gold calls they match: its parallel matcher is greedy (parallel_178).
- kinds in DOCUMENTED_KINDS, where our rule deliberately differs from BFCL's.
- problems that no call can pass (`unpassable_reason`) are left out of the figures; the report
  names them and records any prediction BFCL accepts for them (there must be none).
"""

from __future__ import annotations

import importlib
import json
import sys
import types
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from megatron_apriel.data.converters import convert_bfcl
from megatron_apriel.verifiers.function_calling import FunctionCallingVerifier, match_calls, unpassable_reason
from tools.prepare_data import bfcl_data_dir

BFCL_VERSION = "2026.3.23"
CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "live_simple", "live_multiple")
GOLD_KINDS = ("gold_first", "gold_last", "gold_full", "gold_typed", "gold_reordered")
DOCUMENTED_KINDS = {"int_for_float_in_list": "ints in a list of floats pass here; BFCL's nested type check "
                                             "rejects them unless the parameter may be left out"}
_MODEL = "agreement-test-model"  # a model name for BFCL's checker, registered as keeping dotted names

Call = tuple[str, dict[str, Any]]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_category(category: str) -> list[tuple[dict, list[dict]]]:
    """(question row, ground truth) pairs of one category, in file order."""
    data = bfcl_data_dir()
    if data is None:
        raise RuntimeError(f"bfcl-eval is not installed: pip install --no-deps bfcl-eval=={BFCL_VERSION}")
    answers = {r["id"]: r["ground_truth"] for r in _jsonl(data / "possible_answer" / f"BFCL_v4_{category}.json")}
    return [(row, answers[row["id"]]) for row in _jsonl(data / f"BFCL_v4_{category}.json")]


def bfcl_checker() -> Callable[[list[dict], list[Call], list[dict], str], bool]:
    """BFCL's `ast_checker` as `check(functions, calls, ground_truth, category) -> valid`.

    ast_checker.py imports the model registry (`bfcl_eval.constants.model_config`, which imports
    every model handler and so openai, anthropic, google-genai, ...) only to rename dotted
    function names for some API models. A one-model registry that keeps names stands in for it
    while the checker is imported; the real registry is never loaded.
    """
    registry = "bfcl_eval.constants.model_config"
    stub = types.ModuleType(registry)
    stub.MODEL_CONFIG_MAPPING = {_MODEL: types.SimpleNamespace(underscore_to_dot=False)}
    previous = sys.modules.get(registry)
    sys.modules[registry] = stub
    try:
        ast_eval = importlib.import_module("bfcl_eval.eval_checker.ast_eval.ast_checker")
    finally:
        if previous is None:
            del sys.modules[registry]
        else:
            sys.modules[registry] = previous
    python = importlib.import_module("bfcl_eval.constants.enums").Language.PYTHON

    def check(functions: list[dict], calls: list[Call], ground_truth: list[dict], category: str) -> bool:
        output = [{name: args} for name, args in calls]
        return ast_eval.ast_checker(functions, output, ground_truth, python, category, _MODEL)["valid"]
    return check


# ---------------------------------------------------------------- predictions

_DECLARED = {"string": str, "any": str, "integer": int, "float": float, "boolean": bool,
             "array": list, "tuple": list, "dict": dict}


@dataclass
class _Gold:
    """One gold call, with what the mutations need to know about its parameters."""

    name: str
    options: dict[str, list]
    properties: dict[str, dict]
    required: list[str]

    def mandatory(self, param: str) -> bool:
        return "" not in self.options[param] or param in self.required

    def listed(self, param: str) -> list:
        return [o for o in self.options[param] if o != ""]

    def declared(self, param: str) -> type | None:
        return _DECLARED.get(self.properties.get(param, {}).get("type"))


def _golds(row: dict, ground_truth: list[dict]) -> list[_Gold]:
    schemas = {f["name"]: f["parameters"] for f in row["function"]}
    out = []
    for call in ground_truth:
        (name, options), = call.items()
        params = schemas.get(name, {})
        out.append(_Gold(name, options, params.get("properties", {}), params.get("required", [])))
    return out


def _concrete(option: Any, pick: Callable[[list], Any]) -> Any:
    """The value an allowed value stands for: in a dict (or a list of dicts) each key maps to its
    allowed values, one level deep as in BFCL's checker (a key mapping to a non-list is literal)."""
    if isinstance(option, dict):
        return {k: opts if not isinstance(opts, list) else pick(listed)
                for k, opts in option.items() if not isinstance(opts, list) or (listed := [o for o in opts if o != ""])}
    if isinstance(option, list) and option and all(isinstance(item, dict) for item in option):
        return [_concrete(item, pick) for item in option]
    return option


def _write(gold: _Gold, pick: Callable[[list], Any], everything: bool) -> dict[str, Any]:
    """Arguments of a gold call: its mandatory parameters (if `everything`, also every optional
    one that has a listed value and that the schema declares)."""
    args = {}
    for param in gold.options:
        listed = gold.listed(param)
        if listed and (gold.mandatory(param) or (everything and param in gold.properties)):
            args[param] = _concrete(pick(listed), pick)
        elif gold.mandatory(param):
            args[param] = ""  # the schema requires it, the gold only allows leaving it out
    return args


def _typed(value: Any, declared: type | None) -> Any:
    """A gold value written as the schema's type says (0 -> 0.0 for a float, 5.0 -> 5 for an int)."""
    if declared is float and type(value) is int:
        return float(value)
    if declared is int and type(value) is float and value.is_integer():
        return int(value)
    return value


def _off_list(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 7
    if isinstance(value, str):
        return value + " zz"
    if isinstance(value, list):
        return value + value[-1:] if value else ["zz"]
    return None


def _case_space(value: str) -> str:
    return value.swapcase().replace(" ", "  ") + "."


def _with(calls: list[Call], i: int, param: str, change: Callable[[Any], Any] | None) -> list[Call]:
    """`calls` with argument `param` of call `i` replaced by `change(old)`, or dropped if None."""
    out = list(calls)
    args = dict(calls[i][1])
    if change is None:
        args.pop(param)
    else:
        args[param] = change(args.get(param))
    out[i] = (calls[i][0], args)
    return out


# Mutations of one argument of the base answer: (kind, which(gold, param, value), change(value)
# or None to drop the argument). The first argument, in call order, that `which` accepts changes.
_ARGUMENT_MUTATIONS: list[tuple[str, Callable[[_Gold, str, Any], bool], Callable[[Any], Any] | None]] = [
    ("missing_required", lambda g, p, v: p in g.required, None),
    ("missing_gold_mandatory", lambda g, p, v: p not in g.required and g.mandatory(p), None),
    ("off_list", lambda g, p, v: _off_list(v) is not None, _off_list),
    ("case_space", lambda g, p, v: isinstance(v, str) and v.strip() != "", _case_space),
    ("int_for_float", lambda g, p, v: g.declared(p) is float and type(v) is float and v.is_integer(), int),
    ("float_for_int", lambda g, p, v: g.declared(p) is int and type(v) is int, float),
    ("string_for_number", lambda g, p, v: type(v) in (int, float), str),
    ("null_for_mandatory", lambda g, p, v: g.mandatory(p), lambda v: None),
    ("case_space_in_list", lambda g, p, v: isinstance(v, list) and v and isinstance(v[0], str),
     lambda v: [_case_space(v[0])] + v[1:]),
    ("int_for_float_in_list", lambda g, p, v: isinstance(v, list) and v and type(v[0]) is float and v[0].is_integer(),
     lambda v: [int(v[0])] + v[1:]),
    ("dict_extra_key", lambda g, p, v: isinstance(v, dict), lambda v: {**v, "zz_unknown": 1}),
    ("dict_missing_key", lambda g, p, v: isinstance(v, dict) and v, lambda v: dict(list(v.items())[1:])),
    ("dict_off_value", lambda g, p, v: isinstance(v, dict) and v and _off_list(next(iter(v.values()))) is not None,
     lambda v: {k: _off_list(x) if i == 0 else x for i, (k, x) in enumerate(v.items())}),
    ("dict_case_space", lambda g, p, v: isinstance(v, dict) and any(isinstance(x, str) and x for x in v.values()),
     lambda v: {k: _case_space(x) if isinstance(x, str) and x else x for k, x in v.items()}),
    ("list_of_dicts_extra_key", lambda g, p, v: isinstance(v, list) and v and isinstance(v[0], dict),
     lambda v: [{**v[0], "zz_unknown": 1}] + v[1:]),
]

# Values given to a parameter the base answer leaves out (may be omitted): (kind, applies, value).
_OPTIONAL_MUTATIONS: list[tuple[str, Callable[[_Gold, str], bool], Any]] = [
    ("null_listed", lambda g, p: None in g.options[p], None),
    ("null_unlisted", lambda g, p: None not in g.options[p], None),
    ("empty_string_for_optional", lambda g, p: g.declared(p) is str, ""),
    ("empty_list_for_optional", lambda g, p: g.declared(p) is list, []),
]


def predictions(row: dict, ground_truth: list[dict]) -> Iterator[tuple[str, list[Call]]]:
    """(kind, calls) pairs for one problem: gold answers (kinds in GOLD_KINDS), then mutations."""
    golds = _golds(row, ground_truth)
    base = [(g.name, _write(g, lambda o: o[0], False)) for g in golds]
    yield "gold_first", base
    yield "gold_last", [(g.name, _write(g, lambda o: o[-1], False)) for g in golds]
    yield "gold_full", [(g.name, _write(g, lambda o: o[0], True)) for g in golds]
    yield "gold_typed", [(g.name, {p: _typed(v, g.declared(p)) for p, v in a.items()})
                         for g, (_, a) in zip(golds, base)]
    if len(base) > 1:
        yield "gold_reordered", base[1:] + base[:1]
        yield "dropped_call", base[:-1]
    yield "extra_call", base + base[:1]
    yield "no_call", []
    yield "wrong_name", [(base[0][0] + "_v2", base[0][1])] + base[1:]
    yield "extra_param", _with(base, 0, "zz_unknown", lambda v: 1)
    schema_only = [(i, p) for i, g in enumerate(golds) for p in g.properties if p not in g.options]
    if schema_only:  # a parameter the schema declares but the gold call does not list
        i, p = schema_only[0]
        yield "extra_schema_param", _with(base, i, p, lambda v: golds[i].properties[p].get("default", "x"))
    for kind, which, change in _ARGUMENT_MUTATIONS:
        found = next(((i, p) for i, (_, args) in enumerate(base) for p, v in args.items() if which(golds[i], p, v)),
                     None)
        if found:
            yield kind, _with(base, *found, change)
    left_out = [(i, p) for i, g in enumerate(golds) for p in g.options if p not in base[i][1]]
    undeclared = [(i, p) for i, p in left_out if p not in golds[i].properties and golds[i].listed(p)]
    if undeclared:  # a parameter the gold lists as optional but the schema does not declare
        i, p = undeclared[0]
        yield "undeclared_gold_param", _with(base, i, p, lambda v: golds[i].listed(p)[0])
    for kind, applies, value in _OPTIONAL_MUTATIONS:
        found = next(((i, p) for i, p in left_out if applies(golds[i], p)), None)
        if found:
            yield kind, _with(base, *found, lambda v: value)


# ---------------------------------------------------------------- comparison

@dataclass
class Report:
    """Verdicts of both checkers, counted by (category, kind)."""

    total: Counter = field(default_factory=Counter)
    agree: Counter = field(default_factory=Counter)
    problems: Counter = field(default_factory=Counter)
    accepted_by_bfcl: Counter = field(default_factory=Counter)
    greedy: list[tuple[str, str]] = field(default_factory=list)
    documented: list[tuple[str, str]] = field(default_factory=list)
    undocumented: list[dict] = field(default_factory=list)
    unpassable: dict[str, str] = field(default_factory=dict)
    unpassable_accepted_by_bfcl: list[tuple[str, str]] = field(default_factory=list)

    def rate(self, category: str | None = None, gold: bool | None = None) -> tuple[int, int]:
        """(agreeing, total) predictions of a category (None: all), gold kinds or mutations."""
        keys = [k for k in self.total if category in (None, k[0]) and gold in (None, k[1] in GOLD_KINDS)]
        return sum(self.agree[k] for k in keys), sum(self.total[k] for k in keys)

    def table(self) -> str:
        lines = [f"{'category':<18} {'problems':>8}   {'gold answers':<23}{'mutations':<23}all"]
        for category in [*CATEGORIES, None]:
            cells = [self.rate(category, True), self.rate(category, False), self.rate(category)]
            problems = self.problems[category] if category else sum(self.problems.values())
            lines.append(f"{category or 'overall':<18} {problems:>8}   "
                         + "".join(f"{f'{a}/{n}':>13} {100 * a / max(n, 1):7.3f}%" for a, n in cells))
        kinds = sorted({k for _, k in self.total})
        lines.append("per kind (agree/total): " + ", ".join(
            f"{k} {sum(self.agree[c, k] for c in CATEGORIES)}/{sum(self.total[c, k] for c in CATEGORIES)}"
            for k in kinds))
        lines.append("accepted by BFCL: " + ", ".join(f"{k} {self.accepted_by_bfcl[k]}" for k in kinds))
        lines.append(f"greedy (BFCL's parallel matcher): {self.greedy}")
        lines.append(f"documented kinds: {Counter(k for _, k in self.documented)} {DOCUMENTED_KINDS}")
        lines.append(f"unpassable, left out: {self.unpassable}")
        lines.append(f"undocumented disagreements: {len(self.undocumented)}")
        return "\n".join(lines)


def _message(calls: list[Call]) -> dict:
    """The calls as an OpenAI-style assistant message (arguments as JSON text)."""
    return {"role": "assistant",
            "tool_calls": [{"function": {"name": n, "arguments": json.dumps(a)}} for n, a in calls]}


def _greedy_only(check, functions: list[dict], ground_truth: list[dict], calls: list[Call], category: str) -> bool:
    """BFCL accepts `calls` once they are put in the order of the gold calls that they match."""
    matching = match_calls(calls, ground_truth, functions)
    if not len(matching) == len(ground_truth) == len(calls):
        return False
    return check(functions, [calls[matching[j]] for j in range(len(ground_truth))], ground_truth, category)


def compare(categories: tuple[str, ...] = CATEGORIES) -> Report:
    """Ask both checkers about every prediction of every problem of `categories`."""
    check, verifier, report = bfcl_checker(), FunctionCallingVerifier(), Report()
    for category in categories:
        for index, (row, ground_truth) in enumerate(load_category(category)):
            broken = unpassable_reason(ground_truth, row["function"])
            if broken:
                report.unpassable[row["id"]] = broken
            else:
                report.problems[category] += 1
                problem = convert_bfcl(row, index, {row["id"]: ground_truth})
            for kind, calls in predictions(row, ground_truth):
                message = _message(calls)  # before BFCL's checker sees the calls
                theirs = check(row["function"], calls, ground_truth, category)
                report.accepted_by_bfcl[kind] += theirs
                if broken:
                    if theirs:
                        report.unpassable_accepted_by_bfcl.append((row["id"], kind))
                    continue
                ours = verifier.verify(problem, message).success
                report.total[category, kind] += 1
                if ours == theirs:
                    report.agree[category, kind] += 1
                elif ours and _greedy_only(check, row["function"], ground_truth, calls, category):
                    report.greedy.append((row["id"], kind))
                elif kind in DOCUMENTED_KINDS:
                    report.documented.append((row["id"], kind))
                else:
                    report.undocumented.append({"id": row["id"], "kind": kind, "ours": ours, "bfcl": theirs,
                                                "calls": calls, "ground_truth": ground_truth})
    return report


if __name__ == "__main__":
    result = compare()
    print(result.table())
    for case in result.undocumented[:20]:
        print(json.dumps(case)[:600])

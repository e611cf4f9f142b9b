"""BFCL v4 multi-turn as an environment (``bfcl_multi_turn``): the 800 rows of the categories
base, miss_func, miss_param and long_context (200 each), run on BFCL's own API classes
(GorillaFileSystem, MathAPI, MessageAPI, TwitterAPI, TicketAPI, TradingBot, TravelAPI,
VehicleControlAPI) and scored with the comparisons of BFCL's official multi-turn checker.
Needs the ``bfcl-eval`` wheel (``pip install --no-deps bfcl-eval==2026.3.23``), imported lazily.

The conversation is BFCL's prompting mode, whose tokens only ever grow:
- the start is BFCL's default system prompt (its tools as JSON, calls as a Python list
  ``[func(a=1), g(b='x')]``), then the first turn's user messages;
- each model turn with calls (``calls.py``) is answered with one ``tool`` message per call, the
  result string as BFCL's executor writes it (errors: ``Error during execution: ...``);
- a model turn without a call ends the user turn: the next turn's user message follows, or the
  end after the last turn;
- miss_func: the functions of ``missed_function`` are left out of the system prompt; at their
  turn (whose question is empty) the user message is BFCL's prompting-mode one, the withheld
  functions' docs then "I have updated some more functions you can choose from. What about now?".
  As in BFCL's executor, every public method of the involved classes can be called at any time
  (a withheld one too): BFCL withholds the docs, not the methods;
- miss_param: nothing special; the turn that lacks a parameter has an empty ground truth and the
  next user turn gives the parameter (BFCL's data, row by row);
- ``excluded_function`` is metadata BFCL does not use; neither do we;
- more than ``max_steps_per_turn`` (20) model turns with calls in one user turn end the episode
  (BFCL's force-quit: the row fails unless it was the last turn).

Isolation: each episode loads two fresh sets of instances from the row's ``initial_config``
(BFCL's ``_load_scenario``, on a deep copy, ``long_context`` for that category): the model's, which
its calls change (``tools.Toolbox``, each call in a forked child with a time limit), and the ground
truth's, on which the row's ground-truth calls of each turn run (dataset strings, parsed by the
same ``ast`` reader, run in this process). Nothing is kept in module globals, unlike BFCL's
executor, which keys instances by model name and test id and ``eval``s the call strings.

The reward is BFCL's ``multi_turn_checker`` verdict, computed turn by turn as the episode goes
(the check of a turn needs the state at its end): at the end of user turn t, with a non-empty
ground truth, the model must have made a call in that turn, then the official ``state_checker``
compares the two sets of instances, and the official ``response_checker`` requires every
ground-truth result of turn t among the model's results of all turns so far (as a multiset). The
first failing turn fails the row. Official checker code runs on our instances; none of it
``eval``s anything here. Where we differ from BFCL's prompting decoder on purpose: we pass
positional arguments on (BFCL's decoder drops them, its executor honours them in the ground
truth), a bare name as an argument is not read as a string, and a name that is not a tool method
is answered "not defined" instead of reaching Python's builtins.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from megatron_apriel.envs.base import Reply, Start
from megatron_apriel.envs.calls import Call, parse_calls
from megatron_apriel.envs.config import BfclMultiTurnConfig, ToolCallConfig
from megatron_apriel.envs.tools import Toolbox
from megatron_apriel.records.rollouts import Outcome, Problem
from megatron_apriel.verifiers.base import VerifierResult, correct, failed

CATEGORIES = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context")
REFUSED = frozenset({"kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run"})
"""Names BFCL's executor refuses before it evaluates a call."""


@functools.cache
def _bfcl() -> SimpleNamespace:
    """The parts of bfcl-eval we use, imported on first use (none of them pulls an optional dependency)."""
    config = importlib.import_module("bfcl_eval.constants.executable_backend_config")
    checker = importlib.import_module("bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker")
    prompts = importlib.import_module("bfcl_eval.constants.default_prompts")
    return SimpleNamespace(config=config, checker=checker, prompts=prompts)


def bfcl_data_dir() -> Path | None:
    """``bfcl_eval/data`` of the installed wheel; None without it."""
    spec = importlib.util.find_spec("bfcl_eval")
    return None if spec is None or spec.origin is None else Path(spec.origin).parent / "data"


def problem_from_row(row: dict, ground_truth: list[list[str]]) -> Problem:
    """A BFCL multi-turn question row with its possible answer's ``ground_truth`` (one list of call
    strings per turn); the reference holds what the episode needs."""
    if len(ground_truth) != len(row["question"]):
        raise ValueError(f"{row['id']}: {len(ground_truth)} ground-truth turns for {len(row['question'])} questions")
    category = row["id"].rsplit("_", 1)[0]
    reference = {"turns": row["question"], "ground_truth": ground_truth, "initial_config": row["initial_config"],
                 "involved_classes": row["involved_classes"], "missed_function": row.get("missed_function", {}),
                 "long_context": "long_context" in category}
    return Problem(id=f"bfcl-{row['id']}", domain="function_calling", prompt=row["question"][0],
                   reference=reference, metadata={"source": "bfcl_v4", "category": category,
                                                  "environment": "bfcl_multi_turn"})


def load_problems(category: str) -> list[Problem]:
    """The rows of one of ``CATEGORIES`` from the installed wheel, in file order."""
    data = bfcl_data_dir()
    if data is None:
        raise RuntimeError("bfcl-eval is not installed: pip install --no-deps bfcl-eval==2026.3.23")
    rows = [json.loads(line) for line in (data / f"BFCL_v4_{category}.json").read_text().splitlines() if line]
    answers = {a["id"]: a["ground_truth"] for a in map(json.loads, (data / "possible_answer" /
                                                                    f"BFCL_v4_{category}.json").read_text().splitlines())}
    return [problem_from_row(row, answers[row["id"]]) for row in rows]


@functools.cache
def _class_docs(class_name: str) -> tuple[dict, ...]:
    name = _bfcl().config.MULTI_TURN_FUNC_DOC_FILE_MAPPING[class_name]
    text = (bfcl_data_dir() / "multi_turn_func_doc" / name).read_text()
    return tuple(json.loads(line) for line in text.splitlines() if line.strip())


def tool_docs(involved_classes: list[str], missed: dict[str, list[str]]) -> tuple[list[dict], dict[int, list[dict]]]:
    """The docs offered at the start, and those withheld until turn t (BFCL's
    ``populate_test_cases_with_predefined_functions``). Shared, read-only: never change them."""
    offered = [doc for name in involved_classes for doc in _class_docs(name)]
    added: dict[int, list[dict]] = {}
    for turn, names in missed.items():
        for name in names:
            i = next(i for i, doc in enumerate(offered) if doc["name"] == name)
            added.setdefault(int(turn), []).append(offered.pop(i))
    return offered, added


@functools.lru_cache(maxsize=256)
def _start_text(involved_classes: tuple[str, ...], missed: str) -> str:
    return system_prompt(tool_docs(list(involved_classes), json.loads(missed))[0])


def system_prompt(functions: list[dict]) -> str:
    """BFCL's default system prompt (``DEFAULT_SYSTEM_PROMPT_FORMAT``: plaintext, classic style,
    Python calls without a tag, function docs as JSON)."""
    p = _bfcl().prompts
    style = p.PROMPT_STYLE_TEMPLATES["classic"]
    call_format = style["tool_call_no_tag"].format(output_format=p.OUTPUT_FORMAT_MAPPING["python"],
                                                   param_types=p.PARAM_TYPE_MAPPING["python"])
    tools = style["available_tools"].format(format="json", functions=json.dumps(functions, indent=4))
    return p.PROMPT_TEMPLATE_MAPPING["plaintext"].format(
        persona=style["persona"], task=style["task"], tool_call_format=call_format,
        multiturn_behavior=style["multiturn_behavior"], available_tools=tools)


def new_instances(reference: dict) -> dict[str, Any]:
    """Fresh API instances of a row, loaded from its ``initial_config`` (BFCL's way, without its globals)."""
    config = _bfcl().config
    out = {}
    for name in reference["involved_classes"]:
        instance = getattr(importlib.import_module(config.CLASS_FILE_PATH_MAPPING[name]), name)()
        if name not in config.STATELESS_CLASSES:
            instance._load_scenario(copy.deepcopy(reference["initial_config"].get(name, {})),
                                    long_context=reference["long_context"])
        out[name] = instance
    return out


class BfclMultiTurnEnvironment:
    name = "bfcl_multi_turn"

    def __init__(self, config: BfclMultiTurnConfig | None = None, calls: ToolCallConfig | None = None):
        self.config = config or BfclMultiTurnConfig()
        self.calls = calls or ToolCallConfig()

    def start(self, problem: Problem) -> "BfclEpisode":
        return BfclEpisode(problem, self.config, self.calls)


class BfclEpisode:
    """One trajectory on one row: the model's instances, the ground truth's, and the verdict so far."""

    def __init__(self, problem: Problem, config: BfclMultiTurnConfig, calls: ToolCallConfig):
        ref = problem.reference
        self.problem = problem
        self.max_steps = config.max_steps_per_turn
        self.turns: list[list[dict]] = ref["turns"]
        self.truth_calls: list[list[str]] = ref["ground_truth"]
        self.added = tool_docs(ref["involved_classes"], ref["missed_function"])[1]
        prompt = _start_text(tuple(ref["involved_classes"]), json.dumps(ref["missed_function"], sort_keys=True))
        self.first = Start(messages=({"role": "system", "content": prompt}, *self.turns[0]))
        self.model = Toolbox(new_instances(ref), calls, REFUSED)
        self.truth = Toolbox(new_instances(ref), ToolCallConfig(isolate=False), REFUSED)
        self.turn = 0
        self.steps = 0
        """Model turns with calls in the current user turn."""
        self.turn_results: list[str] = []
        self.all_results: list[str] = []
        self.failure: str | None = None
        self.done = False
        self.force_quit = False

    def step(self, text: str) -> Reply:
        if self.done:
            raise RuntimeError(f"{self.problem.id}: step after the end of the episode")
        calls = parse_calls(text)
        if calls is not None:
            results = self.model.answer_all(calls)
            self.turn_results += results
            self.steps += 1
            if self.steps <= self.max_steps:
                return Reply.tool_results(results)
            self.force_quit = True
        self._end_turn()
        if self.force_quit or self.turn == len(self.turns):
            self.done = True
            return Reply.end()
        return Reply(messages=tuple(self._user_messages(self.turn)))

    def _user_messages(self, turn: int) -> list[dict]:
        if turn in self.added:
            text = _bfcl().prompts.DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING.format(
                functions=self.added[turn])
            return [{"role": "user", "content": text}]
        return self.turns[turn]

    def _end_turn(self) -> None:
        """The official checker's check of this turn (module docstring); the first failure stays."""
        t, truth = self.turn, self.truth_calls[self.turn]
        truth_results = self.truth.answer_all([_truth_call(s) for s in truth])
        self.all_results += self.turn_results
        if self.failure is None and truth:
            self.failure = self._check(t, truth_results)
        self.turn, self.steps, self.turn_results = t + 1, 0, []

    def _check(self, t: int, truth_results: list[str]) -> str | None:
        checker = _bfcl().checker
        if self.steps == 0:
            return f"turn {t}: no call where the ground truth makes {len(truth_results)} (empty_turn_model_response)"
        state = checker.state_checker(self.model.instances, self.truth.instances)
        if not state["valid"]:
            return f"turn {t}: {state['error_message']} {str(state['details']['differences'])[:300]}"
        response = checker.response_checker(self.all_results, truth_results, t)
        if not response["valid"]:
            return f"turn {t}: results missing: {str(response['details']['missing_items'])[:300]}"
        return None

    def score(self) -> VerifierResult:
        if self.turn < len(self.turns):
            what = "more calls than allowed in one turn" if self.force_quit else "the episode was stopped"
            return failed(Outcome.WRONG, f"{what} at turn {self.turn} of {len(self.turns)} (BFCL: force-terminated)")
        if self.failure is not None:
            return failed(Outcome.WRONG, self.failure)
        return correct(f"{len(self.turns)} turns match BFCL's ground truth")


def _truth_call(text: str) -> Call:
    calls = parse_calls(text)
    if calls is None or len(calls) != 1 or not isinstance(calls[0], Call):
        raise ValueError(f"ground-truth call {text!r} is not one call with literal arguments")
    return calls[0]

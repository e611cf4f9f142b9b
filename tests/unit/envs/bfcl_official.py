"""BFCL's official multi-turn checker, run on call sequences derived from the ground truth only,
and the sequences: BFCL's ground truth, and mutations of it (one call dropped, one argument
changed). Shared by the tests of ``envs/bfcl_multi_turn.py``.

The official checker ``eval``s its call strings (``multi_turn_utils.execute_multi_turn_func_call``)
and keeps its API instances in that module's globals, keyed by model name and test id: each
check here uses a model name of its own and removes its instances afterwards. It is given only
strings of BFCL's ground truth or rebuilt from their literal arguments by ``repr``; model text
never reaches it (that is the environment's job, which never evaluates anything).
"""

from __future__ import annotations

import itertools
import random
import re

from megatron_apriel.envs.base import score_episode
from megatron_apriel.envs.bfcl_multi_turn import BfclMultiTurnEnvironment
from megatron_apriel.envs.calls import Call, parse_calls
from megatron_apriel.records.rollouts import Problem

_names = itertools.count()
Steps = list[list[list[str]]]
"""Per user turn, the model's turns with calls, each a list of call strings."""


def official_valid(problem: Problem, steps: Steps) -> bool:
    """The verdict of BFCL's ``multi_turn_checker`` on ``steps`` (ground-truth-derived strings only)."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker, multi_turn_utils

    model = f"agreement_{next(_names)}"
    ref = problem.reference
    entry = {"id": problem.id.removeprefix("bfcl-"), "initial_config": ref["initial_config"],
             "involved_classes": ref["involved_classes"]}
    try:
        return multi_turn_checker.multi_turn_checker(steps, ref["ground_truth"], entry,
                                                     problem.metadata["category"], model)["valid"]
    finally:
        store = vars(multi_turn_utils)
        for key in [k for k in store if k.startswith(model + "_")]:
            del store[key]


def our_valid(env: BfclMultiTurnEnvironment, problem: Problem, steps: Steps) -> bool:
    """Our environment's verdict on the same sequence, sent as model turns: each step as a Python
    list, then a turn without a call to end the user turn."""
    episode = env.start(problem)
    for turn in steps:
        for calls in turn:
            assert not episode.step("[" + ", ".join(calls) + "]").done
        reply = episode.step("Done.")
    assert reply.done
    return score_episode(episode).success


def ground_truth(problem: Problem) -> Steps:
    return [[list(calls)] if calls else [] for calls in problem.reference["ground_truth"]]


def _positions(problem: Problem) -> list[tuple[int, int]]:
    return [(t, i) for t, calls in enumerate(problem.reference["ground_truth"]) for i in range(len(calls))]


def dropped_call(problem: Problem, rng: random.Random) -> Steps:
    """The ground truth without one of its calls (picked by ``rng``)."""
    t, i = rng.choice(_positions(problem))
    turns = [list(calls) for calls in problem.reference["ground_truth"]]
    del turns[t][i]
    return [[calls] if calls else [] for calls in turns]


def changed_argument(problem: Problem, rng: random.Random) -> Steps | None:
    """The ground truth with one argument of one call changed (None when no call has one)."""
    turns = [list(calls) for calls in problem.reference["ground_truth"]]
    candidates = [(t, i) for t, i in _positions(problem) if _has_args(turns[t][i])]
    if not candidates:
        return None
    t, i = rng.choice(candidates)
    call, = parse_calls(turns[t][i])
    assert isinstance(call, Call)
    args, kwargs = list(call.args), dict(call.kwargs)
    keys = [("pos", j) for j in range(len(args))] + [("kw", k) for k in kwargs]
    where, key = rng.choice(keys)
    if where == "pos":
        args[key] = _changed(args[key])
    else:
        kwargs[key] = _changed(kwargs[key])
    turns[t][i] = f"{call.name}({', '.join([repr(a) for a in args] + [f'{k}={v!r}' for k, v in kwargs.items()])})"
    return [[calls] if calls else [] for calls in turns]


def _has_args(text: str) -> bool:
    call, = parse_calls(text)
    return bool(call.args or call.kwargs)


def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return re.sub(r"\w", lambda m: "x" if m.group() != "x" else "y", value, count=1) if value else "x"
    if isinstance(value, list):
        return value[:-1] if value else ["x"]
    if isinstance(value, dict):
        return {k: v for k, v in list(value.items())[:-1]} if value else {"x": 1}
    return "x"


def table() -> None:
    """Every row: the ground truth and both mutations, through ours and the official checker."""
    from collections import Counter

    from megatron_apriel.envs.bfcl_multi_turn import CATEGORIES, load_problems
    from megatron_apriel.envs.config import ToolCallConfig

    env = BfclMultiTurnEnvironment(calls=ToolCallConfig(isolate=False))
    counts: Counter = Counter()
    for category in CATEGORIES:
        for k, problem in enumerate(load_problems(category)):
            rng = random.Random(k)
            for kind, steps in (("ground_truth", ground_truth(problem)), ("dropped_call", dropped_call(problem, rng)),
                                ("changed_argument", changed_argument(problem, rng))):
                if steps is not None:
                    ours, theirs = our_valid(env, problem, steps), official_valid(problem, steps)
                    verdict = "valid" if theirs else "invalid"
                    counts[(category, kind, "agree" if ours == theirs else "DISAGREE", verdict)] += 1
    for key, n in sorted(counts.items()):
        print(*key, n, sep="\t")
    for kind in ("ground_truth", "dropped_call", "changed_argument"):
        agree = sum(n for k, n in counts.items() if k[1] == kind and k[2] == "agree")
        print(f"{kind}: {agree} agree of {sum(n for k, n in counts.items() if k[1] == kind)}")


if __name__ == "__main__":
    table()

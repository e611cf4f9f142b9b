"""Converters from the source formats the paper used to Problem records (RECIPE.md section 6).

Each converter takes one source row (a dict as found in the source file) and its index, and
returns a Problem, or raises `SkipRow` for rows the recipe leaves out (the reason is counted by
`tools/prepare_data.py`). A row that does not have the source format raises ValueError.

Source formats:
- orz: Open-Reasoner-Zero `orz_math_*.json`, a JSON list whose items are
  `[{"from": "human", "value": Q}, {"from": "assistant", "ground_truth": {"value": A}}]`.
- taco / apps: `question`, `input_output` (JSON text: `inputs`, `outputs`, optional `fn_name`),
  `starter_code`, `difficulty` (TACO's VERY_HARD is skipped); at most `max_tests` tests are kept.
- i3_logic: PrimeIntellect/INTELLECT-3-RL `logic` config: `question`, `info` (JSON text with
  `task` and `game_data_str`, itself JSON text holding the `answer`).
- if_multi: allenai/IF_multi_constraints_upto5: `key`, `messages`, `ground_truth` (text of a
  one-element list `[{"instruction_id": [...], "kwargs": [...]}]`, JSON or Python literal).
- bfcl: BFCL v4 question rows (`id`, `question` = list of turns, each a list of `role`/`content`
  messages; `function` = the tool schemas) joined on `id` with the possible-answer rows (`id`,
  `ground_truth`), both JSON lines (the `.json` files of the `bfcl-eval` wheel, `bfcl_eval/data/`
  and `bfcl_eval/data/possible_answer/`). Multi-turn rows, rows without a possible answer and
  rows that no call can pass (`verifiers.function_calling.unpassable_reason`) are skipped.

Evaluation benchmarks (RECIPE.md section 8; read by `apriel-eval` and by `tools/prepare_data.py`):
- aime: AIME jsonl rows with the problem text under `problem` (or `question`) and `answer`, the id
  under `id` or `problem_idx` (else the row number).
- gpqa: the GPQA csv (`Question`, `Correct Answer`, `Incorrect Answer 1..3`, `Record ID`); the four
  options are shuffled per row by `random.Random(f"{seed}:{Record ID}")` and the order shown is
  recorded in the metadata (`shuffle_seed`, `order`: index into [correct, incorrect 1, 2, 3]).
- mmlu_pro: MMLU-Pro parquet rows (`question_id`, `question`, `options`, `answer` letter,
  `answer_index`, `category`), options in their published order.
- livecodebench: LiveCodeBench jsonl (`question_id`, `question_content`, `starter_code`,
  `contest_date`, `public_test_cases`, `private_test_cases`, `metadata` with `func_name` for
  functional problems); public and private tests are all kept (`data/lcb.py` decodes them
  without trusting their pickles); rows outside the window are skipped, by the official runner's rule
  (`start_date <= contest_date <= end_date`, dates at 00:00).
"""

from __future__ import annotations

import ast
import json
import random
from datetime import datetime
from typing import Any, Callable

from megatron_apriel.data.lcb import decode_test_cases, to_verifier_tests
from megatron_apriel.records.rollouts import Problem
from megatron_apriel.verifiers.function_calling import unpassable_reason
from megatron_apriel.verifiers.ifeval import supported_instructions
from megatron_apriel.verifiers.logic import I3_SKIPPED_TASKS

MATH_SUFFIX = "\n\nPut your final answer within \\boxed{}."
CODE_SUFFIX = "\n\nWrite a Python 3 solution in a single ```python code block."
CHOICE_SUFFIX = "\n\nAnswer with the letter of the correct option within \\boxed{}."
LCB_PRELUDE = ("from typing import *\nfrom collections import *\nfrom itertools import *\nfrom functools import *\n"
               "from heapq import *\nfrom bisect import *\nfrom math import *\n"
               "import collections, itertools, functools, heapq, bisect, math, re, string, sys\n")
"""What LiveCodeBench's harness makes available to a solution (its starter code names `List`,
`Optional`, ... without importing them); run before the candidate by the code verifier."""


class SkipRow(Exception):
    """The row is valid but excluded by the recipe; the message is the reason."""


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def convert_orz(item: Any, index: int) -> Problem:
    if not (isinstance(item, list) and len(item) >= 2 and item[0].get("from") == "human"):
        raise ValueError("an ORZ item is [{'from': 'human', 'value': ...}, {'from': 'assistant', 'ground_truth': ...}]")
    answer = item[1]["ground_truth"]["value"]
    if not str(answer).strip():
        raise SkipRow("empty answer")
    return Problem(id=f"orz-{index}", domain="math", prompt=_user(item[0]["value"] + MATH_SUFFIX),
                   reference=str(answer), metadata={"source": "orz"})


def _taco_like(row: dict, index: int, source: str, max_tests: int) -> Problem:
    if str(row.get("difficulty", "")).upper() == "VERY_HARD":
        raise SkipRow("difficulty VERY_HARD")
    if not row.get("input_output"):
        raise SkipRow("no tests")
    io = json.loads(row["input_output"])
    inputs, outputs, fn_name = io.get("inputs", []), io.get("outputs", []), io.get("fn_name")
    if not inputs or len(inputs) != len(outputs):
        raise SkipRow("no tests or inputs/outputs of different lengths")
    tests = []
    for x, y in list(zip(inputs, outputs))[:max_tests]:
        if fn_name:
            # APPS/TACO wrap a call's return value in a one-element list.
            tests.append({"input": x, "output": y[0] if isinstance(y, list) and len(y) == 1 else y})
        else:
            tests.append({"input": x if isinstance(x, str) else "\n".join(x),
                          "output": y if isinstance(y, str) else "\n".join(y)})
    prompt = row["question"]
    if row.get("starter_code"):
        prompt += f"\n\nStart from:\n```python\n{row['starter_code']}\n```"
    reference = {"tests": tests, **({"fn_name": fn_name} if fn_name else {})}
    pid = row.get("problem_id", index)
    return Problem(id=f"{source}-{pid}", domain="code", prompt=_user(prompt + CODE_SUFFIX), reference=reference,
                   metadata={"source": source, "difficulty": row.get("difficulty")})


def convert_taco(row: dict, index: int, max_tests: int = 5) -> Problem:
    return _taco_like(row, index, "taco", max_tests)


def convert_apps(row: dict, index: int, max_tests: int = 5) -> Problem:
    return _taco_like(row, index, "apps", max_tests)


def convert_i3_logic(row: dict, index: int) -> Problem:
    info = json.loads(row["info"])
    task = info["task"]
    if task in I3_SKIPPED_TASKS:
        raise SkipRow(f"task {task} is skipped by the recipe")
    game_data = info.get("game_data_str") or info.get("game_data")
    if isinstance(game_data, str):
        game_data = json.loads(game_data)
    if not isinstance(game_data, dict) or game_data.get("answer") in (None, ""):
        raise SkipRow(f"task {task}: no answer in game_data")
    reference = {"source": "i3_logic", "task": task, "answer": str(game_data["answer"]), "game_data": game_data}
    metadata = {"source": "intellect3_logic", "task": task,
                "difficulty": row.get("avg@16_qwen3_4b_instruct_2507")}
    return Problem(id=f"i3logic-{index}", domain="logic", prompt=_user(row["question"]), reference=reference,
                   metadata=metadata)


def _literal(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return ast.literal_eval(text)


def convert_if_multi(row: dict, index: int) -> Problem:
    truth = _literal(row["ground_truth"]) if isinstance(row["ground_truth"], str) else row["ground_truth"]
    truth = truth[0] if isinstance(truth, list) else truth
    ids = list(truth["instruction_id"])
    kwargs = [{k: v for k, v in (kw or {}).items() if v is not None} for kw in truth["kwargs"]]
    unsupported = sorted(set(ids) - supported_instructions())
    if unsupported:
        raise SkipRow(f"unsupported instructions {unsupported}")
    messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    return Problem(id=f"ifmulti-{row.get('key', index)}", domain="ifeval", prompt=messages,
                   reference={"instruction_id_list": ids, "kwargs": kwargs},
                   metadata={"source": "IF_multi_constraints_upto5"})


def convert_bfcl(row: dict, index: int, answers: dict[str, Any]) -> Problem:
    """A BFCL v4 question row with its possible answer; SkipRow for rows no call can pass."""
    if row["id"] not in answers:
        raise SkipRow("no possible answer (not an AST-checkable category)")
    turns = row["question"]
    if len(turns) != 1:
        raise SkipRow("multi-turn (convert it with bfcl_multi_turn)")
    messages = [{"role": m["role"], "content": m["content"]} for m in turns[0]]
    reference = {"ground_truth": answers[row["id"]], "functions": row["function"]}
    broken = unpassable_reason(reference["ground_truth"], reference["functions"])
    if broken:
        raise SkipRow(f"no call can pass the gold answer: {row['id']}: {broken}")
    return Problem(id=f"bfcl-{row['id']}", domain="function_calling", prompt=messages, reference=reference,
                   metadata={"source": "bfcl_v4", "category": row["id"].rsplit("_", 1)[0], "tools": row["function"]})


def convert_bfcl_multi_turn(row: dict, index: int, answers: dict[str, Any]) -> Problem:
    """A BFCL v4 multi-turn row (base, miss_func, miss_param, long_context) with its possible
    answer: a function_calling problem run by the ``bfcl_multi_turn`` environment
    (``metadata["environment"]``; ``envs/bfcl_multi_turn.py``, whose loader this is)."""
    from megatron_apriel.envs.bfcl_multi_turn import problem_from_row

    if "initial_config" not in row or "involved_classes" not in row:
        raise SkipRow("not a multi-turn row (no initial_config/involved_classes; convert it with bfcl)")
    if row["id"] not in answers:
        raise SkipRow("no possible answer")
    return problem_from_row(row, answers[row["id"]])


# --- evaluation benchmarks --------------------------------------------------------------------

def _text(row: dict, *keys: str) -> str:
    for key in keys:
        value = row.get(key)
        if isinstance(value, str) and value.strip():
            return value.strip()
    raise ValueError(f"no non-empty text under {' or '.join(repr(k) for k in keys)}")


def convert_aime(row: dict, index: int) -> Problem:
    answer = row.get("answer")
    if answer is None or not str(answer).strip():
        raise ValueError("no 'answer'")
    pid = row.get("id", row.get("problem_idx", index + 1))
    return Problem(id=f"aime-{pid}", domain="math", prompt=_user(_text(row, "problem", "question") + MATH_SUFFIX),
                   reference=str(answer).strip(), metadata={"source": "aime"})


def choices_prompt(question: str, options: list[str]) -> str:
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    listed = "\n".join(f"{letters[i]}) {option}" for i, option in enumerate(options))
    return f"{question}\n\n{listed}{CHOICE_SUFFIX}"


def convert_gpqa(row: dict, index: int, seed: int = 0) -> Problem:
    options = [_text(row, "Correct Answer")] + [_text(row, f"Incorrect Answer {i}") for i in (1, 2, 3)]
    record = _text(row, "Record ID")
    order = list(range(4))
    random.Random(f"{seed}:{record}").shuffle(order)
    shown = [options[i] for i in order]
    answer = "ABCD"[order.index(0)]
    return Problem(id=f"gpqa-{record}", domain="multiple_choice",
                   prompt=_user(choices_prompt(_text(row, "Question"), shown)),
                   reference={"answer": answer, "choices": shown},
                   metadata={"source": "gpqa", "shuffle_seed": seed, "order": order,
                             "subdomain": row.get("Subdomain")})


def convert_mmlu_pro(row: dict, index: int) -> Problem:
    options = [str(o) for o in row["options"]]
    if len(options) < 2:
        raise ValueError(f"{len(options)} options; a multiple-choice row needs at least 2")
    answer = str(row["answer"]).strip()
    if "answer_index" in row and row["answer_index"] is not None and "ABCDEFGHIJ"[int(row["answer_index"])] != answer:
        raise ValueError(f"answer {answer!r} disagrees with answer_index {row['answer_index']}")
    if answer not in "ABCDEFGHIJ"[: len(options)] or len(answer) != 1:
        raise ValueError(f"answer {answer!r} is not the letter of one of the {len(options)} options")
    return Problem(id=f"mmlupro-{row['question_id']}", domain="multiple_choice",
                   prompt=_user(choices_prompt(_text(row, "question"), options)),
                   reference={"answer": answer, "choices": options},
                   metadata={"source": "mmlu_pro", "category": row.get("category")})


def lcb_in_window(contest_date: str, start_date: str = "", end_date: str = "") -> bool:
    """LiveCodeBench's own rule (its runner's ``load_code_generation_dataset``): ``start <= contest_date
    <= end`` as datetimes, the bounds (``YYYY-MM-DD``) at 00:00, so a contest on the end date is kept
    only if it is dated midnight. Empty bound: open."""
    when = datetime.fromisoformat(contest_date)
    return (not start_date or datetime.strptime(start_date, "%Y-%m-%d") <= when) and \
        (not end_date or when <= datetime.strptime(end_date, "%Y-%m-%d"))


def convert_livecodebench(row: dict, index: int, start_date: str = "", end_date: str = "") -> Problem:
    """``start_date``/``end_date`` select the contest window (`lcb_in_window`)."""
    if not lcb_in_window(str(row["contest_date"]), start_date, end_date):
        raise SkipRow(f"contest date outside [{start_date or '-'}, {end_date or '-'} 00:00]")
    date = str(row["contest_date"])[:10]
    meta = row.get("metadata") or "{}"
    meta = json.loads(meta) if isinstance(meta, str) else dict(meta)
    fn_name = meta.get("func_name")
    cases = decode_test_cases(row["public_test_cases"]) + decode_test_cases(row["private_test_cases"])
    if not cases:
        raise ValueError("no public or private test cases")
    tests = to_verifier_tests(cases, functional=bool(fn_name))
    prompt = _text(row, "question_content")
    starter = (row.get("starter_code") or "").strip()
    if starter:
        prompt += f"\n\nComplete this starter code (keep its names and signature):\n```python\n{starter}\n```"
    else:
        prompt += "\n\nRead the input from standard input and write the answer to standard output."
    reference = {"tests": tests, "prelude": LCB_PRELUDE, **({"fn_name": fn_name} if fn_name else {})}
    return Problem(id=f"lcb-{row['question_id']}", domain="code", prompt=_user(prompt + CODE_SUFFIX),
                   reference=reference, metadata={"source": "livecodebench", "contest_date": date,
                                                  "platform": row.get("platform"), "difficulty": row.get("difficulty")})


CONVERTERS: dict[str, Callable[..., Problem]] = {
    "orz": convert_orz, "taco": convert_taco, "apps": convert_apps, "i3_logic": convert_i3_logic,
    "if_multi": convert_if_multi, "bfcl": convert_bfcl, "bfcl_multi_turn": convert_bfcl_multi_turn,
    "aime": convert_aime, "gpqa": convert_gpqa, "mmlu_pro": convert_mmlu_pro, "livecodebench": convert_livecodebench,
}

"""The small tasks of ``benchmarks/recipe_mechanisms.py``: problems for the real verifiers, and the
(prompt, answer) pairs a tiny base is warm-started on (``tiny.base.build_task_base``).

Mix (three domains that differ for real):
- math: "What is a + b?", a ``\\boxed{}`` answer, scored by math-verify (fast, short);
- code: "Print a + b.", a ```python block that prints the sum, run by the code verifier in its
  sandbox (a process per test: the slow verifier), longer answers;
- logic: "Sort a b c in ascending order.", a boxed list, scored by the logic verifier (INTELLECT-3
  style answer match).
The warm start sees each problem once per answer; its solve rate then differs per domain because
the tiny model learns the three tasks unequally, not by design.

DAP by difficulty (math only): easy "a + b" and hard "a + b + c". The warm start shows every
problem answered two ways, directly or with its partial sums written out first ("3 + 4 = 7. 7 +
2 = 9."). A 2-layer model adds three digits in one go badly and one pair at a time well, so on hard
problems the long way is more often right, on easy ones it only costs tokens: the setting where a
length penalty that ignores difficulty pushes hard problems towards short, wrong answers.
"""

from __future__ import annotations

import itertools

from megatron_apriel.data.converters import CODE_SUFFIX, MATH_SUFFIX
from megatron_apriel.records.rollouts import Problem
from megatron_apriel.tiny.base import addition_problems, answer_text
from megatron_apriel.verifiers.base import BEGIN_FINAL, END_FINAL

MIX_WEIGHTS = {"math": 0.40, "code": 0.25, "logic": 0.15}
"""The paper's weights of these three domains (RECIPE.md section 1); targets are their shares."""

Example = tuple[list[dict], str]


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def code_problems(max_operand: int) -> list[Problem]:
    return [Problem(id=f"code-{a}-{b}", domain="code", prompt=_user(f"Print {a} + {b}.{CODE_SUFFIX}"),
                    reference={"tests": [{"input": "", "output": str(a + b)}]})
            for a in range(max_operand + 1) for b in range(max_operand + 1)]


def code_answer(total: int) -> str:
    return f"{BEGIN_FINAL}\n```python\nprint({total})\n```\n{END_FINAL}"


def logic_problems(max_operand: int) -> list[Problem]:
    out = []
    for digits in itertools.product(range(max_operand + 1), repeat=3):
        listed = " ".join(map(str, digits))
        out.append(Problem(id=f"sort-{''.join(map(str, digits))}", domain="logic",
                           prompt=_user(f"Sort {listed} in ascending order.{MATH_SUFFIX}"),
                           reference={"source": "i3_logic", "task": "number_sorting",
                                      "answer": " ".join(map(str, sorted(digits)))}))
    return out


def mix_tasks(max_operand: int = 4) -> tuple[list[Problem], list[Example]]:
    """The three domains' problems and one warm-start answer each."""
    math, code, logic = addition_problems(max_operand), code_problems(max_operand), logic_problems(max_operand)
    examples = [(p.prompt, answer_text(int(p.reference))) for p in math]
    examples += [(p.prompt, code_answer(sum(map(int, p.id.split("-")[1:])))) for p in code]
    examples += [(p.prompt, f"{BEGIN_FINAL}\\boxed{{{p.reference['answer']}}}{END_FINAL}") for p in logic]
    return math + code + logic, examples


def sum_problem(operands: tuple[int, ...]) -> Problem:
    level = "easy" if len(operands) == 2 else "hard"
    return Problem(id=f"{level}-{'-'.join(map(str, operands))}", domain="math",
                   prompt=_user(f"What is {' + '.join(map(str, operands))}?{MATH_SUFFIX}"),
                   reference=str(sum(operands)), metadata={"difficulty": level})


def stepwise(operands: tuple[int, ...]) -> str:
    """The partial sums, one addition of two numbers at a time: "3 + 4 = 7. 7 + 2 = 9. " """
    steps, total = [], operands[0]
    for x in operands[1:]:
        steps.append(f"{total} + {x} = {total + x}.")
        total += x
    return " ".join(steps) + " "


def difficulty_tasks(max_operand: int = 4) -> tuple[list[Problem], list[Example]]:
    """Easy (two operands) and hard (three) sums; every problem answered directly and stepwise."""
    digits = range(max_operand + 1)
    operand_sets = list(itertools.product(digits, repeat=2)) + list(itertools.product(digits, repeat=3))
    problems, examples = [], []
    for ops in operand_sets:
        p = sum_problem(ops)
        problems.append(p)
        examples += [(p.prompt, answer_text(sum(ops))), (p.prompt, stepwise(ops) + answer_text(sum(ops)))]
    return problems, examples


def difficulty(problem_id: str) -> str:
    return problem_id.split("-", 1)[0]

"""Write the multi-turn example data of ``smoke_multiturn``:

    pip install --no-deps bfcl-eval==2026.3.23
    PYTHONPATH=. python tools/make_multiturn_example.py examples/data

- ``function_calling_bfcl_multi_turn.jsonl``: the PICK shortest rows of BFCL v4 multi_turn_base
  (converted by tools/prepare_data.py's ``bfcl_multi_turn``; environment ``bfcl_multi_turn``);
  BFCL is Apache-2.0 (examples/data/function_calling_bfcl.LICENSE);
- ``arithmetic.jsonl``: (a + b) * c questions for the calculator environment (``arithmetic``),
  math-domain problems with ``metadata["environment"] = "arithmetic"``.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from megatron_apriel.data.datasets import write_problems
from megatron_apriel.records.rollouts import Problem

PICK = 8


def arithmetic_problems(n: int, seed: int = 0) -> list[Problem]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 9)
        out.append(Problem(id=f"arith-{i}", domain="math",
                           prompt=[{"role": "user", "content": f"What is ({a} + {b}) * {c}?"}],
                           reference={"answer": (a + b) * c},
                           metadata={"source": "arithmetic_example", "environment": "arithmetic"}))
    return out


def bfcl_multi_turn_problems(pick: int) -> list[Problem]:
    from megatron_apriel.envs.bfcl_multi_turn import load_problems

    problems = load_problems("multi_turn_base")
    return sorted(problems, key=lambda p: (len(json.dumps(p.reference)), p.id))[:pick]


def main() -> None:
    out = Path(sys.argv[1])
    print(write_problems(out / "arithmetic.jsonl", arithmetic_problems(32)), "arithmetic problems")
    print(write_problems(out / "function_calling_bfcl_multi_turn.jsonl", bfcl_multi_turn_problems(PICK)),
          "BFCL multi-turn problems")


if __name__ == "__main__":
    main()

"""Verifications per second per domain, single process, on the example problems.

    PYTHONPATH=. python benchmarks/verifiers.py [--seconds 3]

Each domain is timed on its examples/data problems with a gold-style answer (and, for code, one
correct stdin/stdout program run against every test in the local sandbox). The answers repeat, so
math-verify's parse caches make the math figure an upper bound.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from megatron_apriel.data import load_problems
from megatron_apriel.verifiers import verify

DATA = Path(__file__).resolve().parents[1] / "examples" / "data"


def fc_answer(p):
    calls = [{"name": name, "arguments": {k: next(v for v in opts if v != "") for k, opts in args.items()
                                          if any(v != "" for v in opts)}}
             for g in p.reference["ground_truth"] for name, args in g.items()]
    return f"<tool_calls>{json.dumps(calls)}</tool_calls>"


def logic_answer(p):
    return p.reference["entry"]["answer"] if "entry" in p.reference else p.reference["answer"]


def cases():
    wrap = "Here are my reasoning steps:\n...\n[BEGIN FINAL RESPONSE]\n{}\n[END FINAL RESPONSE]".format
    out = {
        "math": [(p, wrap(rf"\boxed{{{p.reference}}}")) for p in load_problems(DATA / "math.jsonl")],
        "logic": [(p, wrap(rf"\boxed{{{logic_answer(p)}}}")) for p in load_problems(DATA / "logic.jsonl")],
        "ifeval": [(p, wrap("a short answer in lowercase without commas"))
                   for p in load_problems(DATA / "ifeval.jsonl")],
        "function_calling": [(p, wrap(fc_answer(p))) for p in load_problems(DATA / "function_calling.jsonl")],
    }
    add = next(p for p in load_problems(DATA / "code.jsonl") if p.id == "code-00")
    out["code"] = [(add, wrap("```python\na, b = map(int, input().split())\nprint(a + b)\n```"))]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="time budget per domain")
    args = parser.parse_args()
    for domain, items in cases().items():
        for problem, completion in items:  # warm-up: imports, langdetect profiles, parser caches
            verify(domain, problem, completion)
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < args.seconds:
            problem, completion = items[n % len(items)]
            verify(domain, problem, completion)
            n += 1
        elapsed = time.perf_counter() - start
        unit = " (each runs 2 tests in the sandbox)" if domain == "code" else ""
        print(f"{domain:<18}{n / elapsed:>9.1f} verifications/s{unit}")


if __name__ == "__main__":
    main()

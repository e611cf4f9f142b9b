"""Small benchmark files written by hand in each public format (for the evaluation tests).

The questions are single-digit sums, which the warm-started tiny model was trained on (its
prompt "What is a + b?" plus the math instruction is exactly what the AIME converter builds), so
its AIME scores are neither all right nor all wrong. The other formats' files are real format
instances (GPQA's csv columns, MMLU-Pro's parquet columns, LiveCodeBench's jsonl with its
base64(zlib(pickle(JSON))) private tests), whatever the tiny model makes of them.
"""

from __future__ import annotations

import base64
import csv
import json
import pickle
import zlib
from pathlib import Path

SUMS = [(1, 2), (3, 4), (2, 2), (0, 4), (4, 3), (1, 1)]


def write_aime(path: Path, sums=SUMS) -> Path:
    with open(path, "w") as f:
        for i, (a, b) in enumerate(sums):
            f.write(json.dumps({"problem_idx": i + 1, "problem": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n")
    return path


GPQA_COLUMNS = ["Pre-Revision Question", "Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2",
                "Incorrect Answer 3", "Explanation", "Record ID", "Subdomain", "High-level domain"]


def write_gpqa(path: Path, sums=SUMS[:3]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=GPQA_COLUMNS)
        w.writeheader()
        for i, (a, b) in enumerate(sums):
            s = a + b
            w.writerow({"Pre-Revision Question": "", "Question": f"What is {a} + {b}?", "Correct Answer": f" {s}\n",
                        "Incorrect Answer 1": str(s + 1), "Incorrect Answer 2": str(s + 2),
                        "Incorrect Answer 3": str(s + 3), "Explanation": "", "Record ID": f"rec{i}",
                        "Subdomain": "Arithmetic", "High-level domain": "Math"})
    return path


def write_mmlu_pro(path: Path, sums=SUMS[:3]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for i, (a, b) in enumerate(sums):
        s = a + b
        options = [str(s + d) for d in (-1, 0, 1, 2, 3)]
        rows.append({"question_id": 100 + i, "question": f"What is {a} + {b}?", "options": options, "answer": "B",
                     "answer_index": 1, "cot_content": "", "category": "math", "src": "fixture"})
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def compress_tests(tests: list[dict]) -> str:
    """LiveCodeBench's encoding of private tests: base64(zlib(pickle(JSON text)))."""
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests)))).decode()


def lcb_rows() -> list[dict]:
    stdin_public = [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]
    stdin_private = [{"input": "4 4\n", "output": "8\n", "testtype": "stdin"},
                     {"input": "0 3\n", "output": "3\n", "testtype": "stdin"}]
    fn_public = [{"input": "[1, 2, 3]", "output": "6", "testtype": "functional"}]
    fn_private = [{"input": "[]", "output": "0", "testtype": "functional"},
                  {"input": "[5, -2]", "output": "3", "testtype": "functional"}]
    common = {"platform": "atcoder", "contest_id": "abc000", "difficulty": "easy"}
    return [
        {**common, "question_title": "Sum", "question_content": "Read two integers and print their sum.",
         "question_id": "abc000_a", "contest_date": "2024-09-01T00:00:00", "starter_code": "",
         "public_test_cases": json.dumps(stdin_public), "private_test_cases": compress_tests(stdin_private),
         "metadata": "{}"},
        {**common, "platform": "leetcode", "question_title": "List sum", "question_content": "Return the sum of nums.",
         "question_id": "3001", "contest_date": "2024-12-01T00:00:00",
         "starter_code": "class Solution:\n    def listSum(self, nums: List[int]) -> int:\n        ",
         "public_test_cases": json.dumps(fn_public), "private_test_cases": compress_tests(fn_private),
         "metadata": json.dumps({"func_name": "listSum"})},
        {**common, "question_title": "Old", "question_content": "Out of the v5 window.", "question_id": "abc001_a",
         "contest_date": "2023-05-01T00:00:00", "starter_code": "", "public_test_cases": json.dumps(stdin_public),
         "private_test_cases": compress_tests(stdin_private), "metadata": "{}"},
    ]


def write_lcb(path: Path) -> Path:
    with open(path, "w") as f:
        for row in lcb_rows():
            f.write(json.dumps(row) + "\n")
    return path


def write_all(d: Path) -> dict[str, Path]:
    """One file per format in ``d``: {format: path}."""
    d.mkdir(parents=True, exist_ok=True)
    return {"aime": write_aime(d / "aime.jsonl"), "gpqa": write_gpqa(d / "gpqa_diamond.csv"),
            "mmlu_pro": write_mmlu_pro(d / "mmlu_pro.parquet"), "livecodebench": write_lcb(d / "lcb.jsonl")}


def write_demo(d: Path) -> dict[str, Path]:
    """The README's example: every format's file, plus ``sums.jsonl``, all 25 sums of the tiny task
    in AIME's format."""
    files = write_all(d)
    files["sums"] = write_aime(d / "sums.jsonl", [(a, b) for a in range(5) for b in range(5)])
    return files

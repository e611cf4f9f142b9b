"""apriel-eval steps with a real judge endpoint: the shared vLLM server of the tiny model (one
server for the whole vLLM suite, tests/vllm/conftest.py). The tiny model writes no valid
segmentation, so every response must end failed with a reason the judge's answer earned (not a
transport error), the run exit 0 and the report give the failure share. The packaged prompts
hold ~670 tiny-tokenizer tokens, more than the server's 512-token context: the test passes a
short prompts file of the same shape (``--judge-prompts``)."""

import json

import httpx
import pytest

from megatron_apriel.entrypoints.eval import main
from tests.steps_fixtures import write_evaluation

pytestmark = pytest.mark.vllm

SHORT_PROMPTS = """version: 1001
labels:
  problem_setup: setup
  forward_reasoning: compute
  verification: check
  backtracking: pivot
  subgoal_setting: target
  backward_chaining: backward
  final_answer: answer
  other: filler
segmentation: Split the trace into verbatim steps.
classification: "Label each step: {labels}"
answer_format: 'Answer {"steps": [{"text": "...", "label": "..."}]}'
retry: "Rejected: {reason}"
"""


def test_the_tiny_model_as_judge_fails_cleanly_with_the_failure_share(vllm_server, tiny_model_dir, tmp_path, capsys):
    ev = write_evaluation(tmp_path / "ev", "tiny", {"aime": [("So 1 + 2 = 3.\n\nThe answer is 3.", True),
                                                             ("Wait, 2 + 2 = 4.", False)]})
    (ev / "manifest.json").write_text(json.dumps({"checkpoint": tiny_model_dir}))  # its tokenizer counts tokens
    prompts = tmp_path / "short.yaml"
    prompts.write_text(SHORT_PROMPTS)
    model = httpx.get(f"{vllm_server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    argv = ["steps", str(ev), "--all", "--no-progress", "--judge-url", vllm_server.url, "--judge-model", model,
            "--judge-prompts", str(prompts), "--judge-max-tokens", "16", "--judge-attempts", "2"]
    assert main(argv) == 0
    report = json.loads(next((ev / "steps").glob("judge-*/report.json")).read_text())
    b = report["benchmarks"]["aime"]
    assert (b["responses"], b["failed"], b["failure_share"]) == (2, 2, 1.0)
    assert set(b["failure_reasons"]) <= {"malformed_json", "not_verbatim", "bad_label"}, b["failure_reasons"]
    assert report["method"]["judge"]["throughput"]["requests"] == 4  # two attempts each, answered
    assert "2 (100.0%)" in capsys.readouterr().out

    assert main(["steps", str(ev), "--all", "--no-progress"]) == 0  # offline: the evaluated model's tokens
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    steps = ["So 1 + 2 = 3.\n\n", "The answer is 3.", "Wait, 2 + 2 = 4."]
    counts = [len(tok(s, add_special_tokens=False)["input_ids"]) for s in steps]
    offline = json.loads((ev / "steps" / "offline" / "report.json").read_text())
    assert tiny_model_dir in offline["tokens"]
    assert offline["benchmarks"]["aime"]["tokens_per_step"]["mean"] == pytest.approx(sum(counts) / 3)

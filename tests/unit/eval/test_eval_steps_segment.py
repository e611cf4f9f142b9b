"""apriel-eval steps, the parts without a judge: the offline segmenter, long-trace windows, the
checks of a judge's answer and the prompts file. Expected values are hand counts."""

import json

import pytest

from megatron_apriel.eval.steps.offline import OfflineConfig, segment
from megatron_apriel.eval.steps.prompts import LABELS, load_prompts
from megatron_apriel.eval.steps.validate import Failure, Rejection, check_answer
from megatron_apriel.eval.steps.windows import Refusal, split_windows

TRACE = ("We are given a + b.\n\nFirst, compute 3 + 4 = 7.\n  \n\nCheck: 7 - 4 = 3. Good.\n\n"
         "[BEGIN FINAL RESPONSE]\\boxed{7}\n\nDone.[END FINAL RESPONSE]")


def test_offline_segmenter_paragraphs_and_answer_block():
    steps = segment(TRACE)
    assert steps == ["We are given a + b.\n\n", "First, compute 3 + 4 = 7.\n  \n\n", "Check: 7 - 4 = 3. Good.\n\n",
                     "[BEGIN FINAL RESPONSE]\\boxed{7}\n\nDone.[END FINAL RESPONSE]"]
    assert "".join(steps) == TRACE


def test_offline_segmenter_long_paragraph_cut_at_sentences():
    text = "One two. Three four! Five six?\nSeven eight."
    # sentences: "One two. " (9), "Three four! " (12), "Five six?\n" (10), "Seven eight." (12)
    assert segment(text, OfflineConfig(max_step_chars=22)) == ["One two. Three four! ", "Five six?\nSeven eight."]
    assert segment(text, OfflineConfig(max_step_chars=5)) == ["One two. ", "Three four! ", "Five six?\n",
                                                               "Seven eight."]
    assert segment(text) == [text]  # shorter than the default 800


def test_offline_segmenter_whitespace_and_empty():
    assert segment("\n\nHello.\n\n\n") == ["\n\nHello.\n\n\n"]
    assert segment("") == []
    assert segment("[BEGIN FINAL RESPONSE]7") == ["[BEGIN FINAL RESPONSE]7"]


def test_windows_cut_at_paragraphs_then_sentences_or_refuse():
    text = "aaaa.\n\nbbbb.\n\ncccc cccc. dddd.\n\n"
    assert split_windows(text, 100) == [text]
    # paragraphs 7, 7, 19 characters; the third is longer than 12, so its sentences (11, 8) are the units
    assert split_windows(text, 14) == ["aaaa.\n\nbbbb.\n\n", "cccc cccc. ", "dddd.\n\n"]
    refused = split_windows("x" * 30 + ".\n\nshort.", 20)
    assert isinstance(refused, Refusal) and "characters 0-33 hold no paragraph break or sentence end" in refused.reason


def good(window: str, labels=None) -> str:
    steps = segment(window)
    labels = labels or ["forward_reasoning"] * len(steps)
    return json.dumps({"steps": [{"text": s, "summary": "-", "label": lab} for s, lab in zip(steps, labels)]})


def test_a_correct_answer_is_accepted_fenced_or_bare():
    steps = check_answer(good(TRACE, ["Problem setup", "subgoal-setting", "verification", "final_answer"]), TRACE)
    assert [s.label for s in steps] == ["problem_setup", "subgoal_setting", "verification", "final_answer"]
    assert len(check_answer("```json\n" + good(TRACE) + "\n```", TRACE)) == 4


@pytest.mark.parametrize("content, kind, says", [
    ("not json", Failure.MALFORMED, "not JSON"),
    ('{"steps": []}', Failure.MALFORMED, 'no non-empty "steps"'),
    ('{"steps": [{"label": "other"}]}', Failure.MALFORMED, 'step 0 has no non-empty "text"'),
    (json.dumps({"steps": [{"text": TRACE[:-1], "label": "other"}]}), Failure.NOT_VERBATIM,
     f"differ from the trace ({len(TRACE)} characters) at character {len(TRACE) - 1}"),
    (json.dumps({"steps": [{"text": "X" + TRACE[1:], "label": "other"}]}), Failure.NOT_VERBATIM, "at character 0"),
    (json.dumps({"steps": [{"text": TRACE, "label": "planning"}]}), Failure.BAD_LABEL, "label 'planning'"),
    (json.dumps({"steps": [{"text": TRACE, "label": ["other", "verification"]}]}), Failure.BAD_LABEL, "step 0"),
    (json.dumps({"steps": [{"text": TRACE}]}), Failure.BAD_LABEL, "label None"),
])
def test_a_wrong_answer_is_rejected_with_its_reason(content, kind, says):
    rejection = check_answer(content, TRACE)
    assert isinstance(rejection, Rejection) and rejection.kind == kind and says in rejection.detail


def test_prompts_file_is_versioned_and_names_the_eight_labels(tmp_path):
    prompts = load_prompts()
    assert prompts.version == 1 and all(f"- {label}:" in prompts.system for label in LABELS)
    assert "because" not in prompts.retry_message("x") and "rejected: x" in prompts.retry_message("x")
    bad = tmp_path / "p.yaml"
    bad.write_text("version: 1\nlabels: {other: x}\nsegmentation: a\nclassification: b\nanswer_format: c\nretry: d\n")
    with pytest.raises(ValueError, match="not the eight of RECIPE.md section 11"):
        load_prompts(bad)

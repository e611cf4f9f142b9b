"""apriel-eval steps, the parts without a judge: the offline segmenter, long-trace windows, the
checks of a judge's answer and the prompts file. Expected values are hand counts."""

import json

import pytest

from megatron_apriel.eval.steps.offline import OfflineConfig, segment
from megatron_apriel.eval.steps.prompts import LABELS, PROMPTS_FILES, load_prompts
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


@pytest.mark.parametrize("wrap", [
    "Here is the segmentation:\n\n```json\n{}\n```\nEach step has one label.",  # prose, a fence, prose
    "{} I hope this helps; {{braces}} in prose are no JSON.",  # the object first
    "{}\n\nSame again:\n{}",  # the same object twice counts once
    "<think>Maybe {{\"steps\": []}}? No.</think>\n{}",  # a reasoning model's thoughts are dropped
])
def test_the_one_object_is_found_wherever_it_stands(wrap):
    answer = good(TRACE)
    steps = check_answer(wrap.replace("{}", answer).replace("{{", "{").replace("}}", "}"), TRACE)
    assert not isinstance(steps, Rejection) and "".join(s.text for s in steps) == TRACE


def test_whitespace_differences_are_forgiven_and_the_steps_are_cut_from_the_trace():
    stripped = json.dumps({"steps": [{"text": " ".join(s.split()), "label": "other"} for s in segment(TRACE)]})
    steps = check_answer(stripped, TRACE)
    assert [s.text for s in steps] == segment(TRACE)  # the trace's own characters, whitespace and all
    whitespace_only = json.dumps({"steps": [{"text": "\n\n", "label": "other"}, {"text": TRACE, "label": "other"}]})
    assert "step 0 holds only whitespace" in check_answer(whitespace_only, TRACE).detail


@pytest.mark.parametrize("content, kind, says", [
    ("not json", Failure.MALFORMED, "no JSON object"),
    ('{"steps": [{"text": "unterminated', Failure.MALFORMED, "not JSON (Unterminated string"),
    ('{"answer": 3}', Failure.MALFORMED, 'no object with a "steps" list'),
    ('{"steps": [{"text": "a", "label": "other"}]} or {"steps": [{"text": "b", "label": "other"}]}',
     Failure.MALFORMED, '2 different JSON objects with "steps"'),
    ('{"steps": []}', Failure.MALFORMED, 'no non-empty "steps"'),
    ('{"steps": [{"label": "other"}]}', Failure.MALFORMED, 'step 0 has no non-empty "text"'),
    (json.dumps({"steps": [{"text": TRACE[:-1], "label": "other"}]}), Failure.NOT_VERBATIM,
     f"end at trace character {len(TRACE) - 1}, before the trace does: it goes on with ']'"),
    (json.dumps({"steps": [{"text": "X" + TRACE[1:], "label": "other"}]}), Failure.NOT_VERBATIM,
     "at trace character 0: trace 'We are given"),
    (json.dumps({"steps": [{"text": TRACE.replace("3 + 4", "3 + 5"), "label": "other"}]}), Failure.NOT_VERBATIM,
     f"at trace character {TRACE.index('4 = 7')}: trace '4 = 7."),
    (json.dumps({"steps": [{"text": TRACE + " Done.", "label": "other"}]}), Failure.NOT_VERBATIM,
     "go on after the trace ends (whitespace aside): step 0 adds 'Done.'"),
    (json.dumps({"steps": [{"text": TRACE, "label": "planning"}]}), Failure.BAD_LABEL, "label 'planning'"),
    (json.dumps({"steps": [{"text": TRACE, "label": ["other", "verification"]}]}), Failure.BAD_LABEL, "step 0"),
    (json.dumps({"steps": [{"text": TRACE}]}), Failure.BAD_LABEL, "label None"),
])
def test_a_wrong_answer_is_rejected_with_its_reason(content, kind, says):
    rejection = check_answer(content, TRACE)
    assert isinstance(rejection, Rejection) and rejection.kind == kind and says in rejection.detail, rejection


def starts(*quoted: str) -> str:
    return json.dumps({"steps": [{"start": q, "label": "other"} for q in quoted]})


def test_boundaries_cut_the_trace_at_each_quoted_start():
    steps = check_answer(starts("We are given", "First,  compute 3", "Check: 7 - 4...", "[BEGIN FINAL"), TRACE,
                         "boundaries")
    assert [s.text for s in steps] == segment(TRACE)
    # a step may start anywhere a word starts, here inside the answer block
    steps = check_answer(starts("We are", "First,", "Check:", "[BEGIN", "Done."), TRACE, "boundaries")
    # the next start decides: "3" occurs once before "Check" (the "= 3" after it is not step 1's)
    assert len(check_answer(starts("We", "3", "Check"), TRACE, "boundaries")) == 3
    assert [s.text for s in steps][-2:] == ["[BEGIN FINAL RESPONSE]\\boxed{7}\n\n", "Done.[END FINAL RESPONSE]"]


@pytest.mark.parametrize("quoted, says", [
    (("We are given", "First, compute 3 + 5"), "step 1's start 'First, compute 3 + 5' is not in the trace after"),
    (("are given", "First,"), "step 0's start 'are given' is not how the trace begins"),
    (("We are given", "Check:", "First,"), "step 2's start 'First,' is not in the trace after step 1's"),
    (("We are given", "7"), "step 1's start '7' is ambiguous: it occurs 3 times"),  # 7, 7 - 4, boxed{7}
    (("We", "3", "Good."), "step 1's start '3' is ambiguous: it occurs 2 times"),  # 3 + 4, 4 = 3 (before Good.)
    (("We", "ompute"), "step 1's start 'ompute' is not in the trace"),  # inside a word: no step starts there
    (("We", "  "), "step 1 has an empty start"),
])
def test_a_missing_or_ambiguous_start_is_rejected_with_its_reason(quoted, says):
    rejection = check_answer(starts(*quoted), TRACE, "boundaries")
    assert isinstance(rejection, Rejection) and rejection.kind == Failure.BAD_BOUNDARY and says in rejection.detail, \
        rejection


def test_prompts_file_is_versioned_and_names_the_eight_labels(tmp_path):
    prompts, copy = load_prompts(), load_prompts(PROMPTS_FILES["copy"])
    assert (prompts.version, prompts.mode, copy.version, copy.mode) == (2, "boundaries", 1, "copy")
    assert all(f"- {label}:" in p.system for label in LABELS for p in (prompts, copy))
    assert prompts.fingerprint != copy.fingerprint
    assert "because" not in prompts.retry_message("x") and "rejected: x" in prompts.retry_message("x")
    bad = tmp_path / "p.yaml"
    bad.write_text("version: 1\nlabels: {other: x}\nsegmentation: a\nclassification: b\nanswer_format: c\nretry: d\n")
    with pytest.raises(ValueError, match="not the eight of RECIPE.md section 11"):
        load_prompts(bad)

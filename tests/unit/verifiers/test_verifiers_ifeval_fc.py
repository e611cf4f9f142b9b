import json

import pytest

from megatron_apriel.verifiers import Outcome, verify
from megatron_apriel.verifiers.function_calling import parse_tool_calls
from tests.unit.conftest import apriel, make_problem


def ifeval_problem(ids, kwargs, prompt="Write a short note."):
    return make_problem("ifeval", {"instruction_id_list": ids, "kwargs": kwargs}, prompt)


def test_ifeval_all_followed():
    p = ifeval_problem(["punctuation:no_comma", "keywords:existence", "change_case:english_lowercase"],
                       [{}, {"keywords": ["apple"]}, {}])
    r = verify("ifeval", p, apriel("i like to eat an apple every single day because it keeps the doctor away"))
    assert r.success and r.score == 1.0


def test_ifeval_partial_credit():
    p = ifeval_problem(["punctuation:no_comma", "keywords:existence", "change_case:english_lowercase"],
                       [{}, {"keywords": ["apple"]}, {}])
    r = verify("ifeval", p, apriel("I like an apple, every day"))  # comma and uppercase: 1 of 3
    assert r.outcome is Outcome.WRONG and r.score == pytest.approx(1 / 3) and not r.success


def test_ifeval_counts_and_format():
    p = ifeval_problem(["length_constraints:number_words", "detectable_format:number_bullet_lists",
                        "detectable_content:postscript"],
                       [{"num_words": 8, "relation": "less than"}, {"num_bullets": 2}, {"postscript_marker": "P.S."}])
    good = "* one\n* two\nP.S. ok"
    assert verify("ifeval", p, apriel(good)).success
    r = verify("ifeval", p, apriel("* one\n* two\n* three and many more words here"))
    assert r.score == 0.0  # three bullets, no postscript, 10 words
    r = verify("ifeval", p, apriel("* one\n* two\nP.S. ok but this adds far too many words"))
    assert r.score == pytest.approx(2 / 3)


def test_ifeval_only_final_response_is_checked():
    p = ifeval_problem(["punctuation:no_comma"], [{}])
    assert verify("ifeval", p, apriel("no commas here", reasoning="well, well, well")).success


def test_ifeval_unknown_instruction_is_verifier_error():
    r = verify("ifeval", ifeval_problem(["made:up"], [{}]), apriel("x"))
    assert r.outcome is Outcome.VERIFIER_ERROR and "made:up" in r.detail


WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string"}}, "required": ["city"]}}


def fc_problem(gold, functions=(WEATHER,)):
    return make_problem("function_calling", {"ground_truth": gold, "functions": list(functions)})


def calls(*items):
    return apriel("<tool_calls>" + json.dumps([{"name": n, "arguments": a} for n, a in items]) + "</tool_calls>")


def test_fc_simple_match_and_optional_param():
    p = fc_problem([{"get_weather": {"city": ["Paris", "Paris, France"], "unit": ["celsius", ""]}}])
    assert verify("function_calling", p, calls(("get_weather", {"city": "paris"}))).success
    assert verify("function_calling", p, calls(("get_weather", {"city": "Paris, France", "unit": "celsius"}))).success


@pytest.mark.parametrize("call", [("get_wether", {"city": "Paris"}),            # wrong name
                                  ("get_weather", {"unit": "celsius"}),          # missing required
                                  ("get_weather", {"city": "Lyon"}),             # value not allowed
                                  ("get_weather", {"city": "Paris", "x": 1})])   # unexpected parameter
def test_fc_mismatches(call):
    p = fc_problem([{"get_weather": {"city": ["Paris"], "unit": ["celsius", ""]}}])
    r = verify("function_calling", p, calls(call))
    assert r.outcome is Outcome.WRONG and r.score == 0.0


def test_fc_types():
    fn = {"name": "area", "parameters": {"type": "object", "properties": {
        "r": {"type": "number"}, "exact": {"type": "boolean"}}, "required": ["r", "exact"]}}
    p = fc_problem([{"area": {"r": [2.0], "exact": [True]}}], [fn])
    assert verify("function_calling", p, calls(("area", {"r": 2, "exact": True}))).success
    assert not verify("function_calling", p, calls(("area", {"r": 2, "exact": 1}))).success
    assert not verify("function_calling", p, calls(("area", {"r": "2", "exact": True}))).success


def test_fc_parallel_partial_credit_any_order():
    gold = [{"get_weather": {"city": [c], "unit": ["", "celsius"]}} for c in ("Paris", "Rome", "Oslo")]
    p = fc_problem(gold)
    full = calls(("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Paris"}),
                 ("get_weather", {"city": "Rome"}))
    assert verify("function_calling", p, full).success
    r = verify("function_calling", p, calls(("get_weather", {"city": "Rome"}), ("get_weather", {"city": "Paris"})))
    assert r.score == pytest.approx(2 / 3) and not r.success
    # duplicates cannot match two gold calls
    r = verify("function_calling", p, calls(("get_weather", {"city": "Rome"}), ("get_weather", {"city": "Rome"})))
    assert r.score == pytest.approx(1 / 3)


def test_fc_gold_parameter_without_blank_is_needed_even_if_the_schema_has_a_default():
    # BFCL simple_python_23: "prime factors of 60 in the form of a dictionary"
    fn = {"name": "prime_factorize", "parameters": {"type": "dict", "properties": {
        "number": {"type": "integer"}, "return_type": {"type": "string", "default": "list"}}, "required": ["number"]}}
    p = fc_problem([{"prime_factorize": {"number": [60], "return_type": ["dictionary"]}}], [fn])
    r = verify("function_calling", p, calls(("prime_factorize", {"number": 60})))
    assert r.outcome is Outcome.WRONG and r.score == 0.0
    assert verify("function_calling", p,
                  calls(("prime_factorize", {"number": 60, "return_type": "dictionary"}))).success


def test_fc_explicit_null():
    fn = {"name": "power", "parameters": {"type": "dict", "properties": {
        "base": {"type": "integer"}, "mod": {"type": "integer"}, "exp": {"type": "integer"}}, "required": ["base"]}}
    p = fc_problem([{"power": {"base": [2], "mod": ["", None], "exp": ["", 3]}}], [fn])  # as in parallel_152
    assert verify("function_calling", p, calls(("power", {"base": 2, "mod": None}))).success
    assert verify("function_calling", p, calls(("power", {"base": 2}))).success
    assert not verify("function_calling", p, calls(("power", {"base": 2, "exp": None}))).success  # null not listed
    assert not verify("function_calling", p, calls(("power", {"base": None}))).success
    only_null = fc_problem([{"power": {"base": [2], "mod": [None]}}], [fn])
    assert verify("function_calling", only_null, calls(("power", {"base": 2, "mod": None}))).success
    assert not verify("function_calling", only_null, calls(("power", {"base": 2}))).success


def test_fc_values_follow_the_declared_type():
    fn = {"name": "book", "parameters": {"type": "dict", "properties": {
        "rooms": {"type": "integer"}, "speed": {"type": "float"}, "city": {"type": "string"}}, "required": []}}
    p = fc_problem([{"book": {"rooms": ["dontcare"], "speed": [0], "city": ["New York"]}}], [fn])
    assert verify("function_calling", p,
                  calls(("book", {"rooms": "dontcare", "speed": 0.0, "city": "new-york"}))).success
    # a gold value of another type than declared is a literal: no standardisation
    assert not verify("function_calling", p,
                      calls(("book", {"rooms": "DontCare", "speed": 0, "city": "New York"}))).success
    assert not verify("function_calling", p, calls(("book", {"rooms": "dontcare", "speed": 0, "city": 5}))).success


def test_fc_parameter_outside_the_schema_is_rejected():
    p = fc_problem([{"get_weather": {"city": ["Paris"], "days": ["", 3]}}])
    assert verify("function_calling", p, calls(("get_weather", {"city": "Paris"}))).success
    assert not verify("function_calling", p, calls(("get_weather", {"city": "Paris", "days": 3}))).success


@pytest.mark.parametrize("gold", [{"get_weather": {"city": ["Paris"], "country": ["France"]}},   # undeclared
                                  {"get_weather": {"city": []}},                                # nothing allowed
                                  {"get_weather": {"unit": ["celsius"]}},                       # required city
                                  {"get_time": {"city": ["Paris"]}}])                           # unknown tool
def test_fc_unpassable_problem_is_a_verifier_error(gold):
    r = verify("function_calling", fc_problem([gold]), calls(("get_weather", {"city": "Paris"})))
    assert r.outcome is Outcome.VERIFIER_ERROR and "no call can pass" in r.detail


def test_fc_extra_calls_are_penalised():
    p = fc_problem([{"get_weather": {"city": ["Paris"], "unit": [""]}}])
    r = verify("function_calling", p, calls(("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})))
    assert r.outcome is Outcome.WRONG and r.score == pytest.approx(1 / 2)


def test_fc_one_to_one_matching_beats_greedy_order():
    # BFCL parallel_178: the first gold call allows either company, the last only Apple; a greedy
    # matcher gives Apple's call to the first gold call and then cannot match the last one.
    gold = [{"get_weather": {"city": ["Paris", "Rome"], "unit": [""]}},
            {"get_weather": {"city": ["Oslo"], "unit": [""]}},
            {"get_weather": {"city": ["Rome"], "unit": [""]}}]
    p = fc_problem(gold)
    preds = calls(("get_weather", {"city": "Rome"}), ("get_weather", {"city": "Oslo"}),
                  ("get_weather", {"city": "Paris"}))
    assert verify("function_calling", p, preds).success


def test_fc_openai_format_and_parse_failures():
    p = fc_problem([{"get_weather": {"city": ["Paris"], "unit": [""]}}])
    msg = {"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]}
    assert verify("function_calling", p, msg).success
    assert parse_tool_calls(msg) == [("get_weather", {"city": "Paris"})]
    assert verify("function_calling", p,
                  apriel("<tool_calls>[{'name': oops</tool_calls>")).outcome is Outcome.UNPARSABLE
    assert verify("function_calling", p, apriel("It is sunny.")).outcome is Outcome.NO_ANSWER
    assert verify("function_calling", fc_problem([]), calls(("f", {}))).outcome is Outcome.VERIFIER_ERROR

"""The domain mix on the command line: written out in every composed config, and each override
form (the whole mix, one domain changed, added or dropped) on the presets with the paper's mix
and on one with its own (tiny_cpu: math only); what does not fit is refused in one line."""

import pytest

from megatron_apriel.config import compose_config, to_run_config
from megatron_apriel.sampling import DOMAIN_MIX_PAPER

CLUSTER = ["model.hf_path=/m", "actor.data=[/d.jsonl]"]
PRESETS = {"apriel_15b": CLUSTER, "qwen3_30b_a3b": CLUSTER, "smoke_5domains": []}
PAPER = dict(DOMAIN_MIX_PAPER)


def mix(preset: str, *overrides: str) -> dict:
    cfg = compose_config(preset, [*PRESETS.get(preset, []), *overrides])
    composed = dict(cfg.actor.sampler.weights)  # written out in the composed config itself
    assert to_run_config(cfg).actor.sampler.mix == composed
    return composed


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_paper_presets_write_the_paper_mix_out(preset):
    assert mix(preset) == PAPER


WITHOUT_MATH = {d: w for d, w in PAPER.items() if d != "math"}
FORMS = {  # form: (overrides, the mix they give on the paper's mix, on tiny_cpu's {math: 1.0})
    "whole": (["actor.sampler.weights={math:0.6,code:0.4}"], {"math": 0.6, "code": 0.4}, {"math": 0.6, "code": 0.4}),
    "change": (["actor.sampler.weights.math=0.3"], {**PAPER, "math": 0.3}, {"math": 0.3}),
    "add": (["+actor.sampler.weights.science=0.2"], {**PAPER, "science": 0.2}, {"math": 1.0, "science": 0.2}),
    "add_or_change": (["++actor.sampler.weights.code=2"], {**PAPER, "code": 2.0}, {"math": 1.0, "code": 2.0}),
    "drop": (["++actor.sampler.weights.logic=1", "~actor.sampler.weights.math"], {**WITHOUT_MATH, "logic": 1.0},
             {"logic": 1.0}),
    "in_order": (["actor.sampler.weights={math:1,code:1}", "+actor.sampler.weights.logic=0.5",
                  "actor.sampler.weights.code=3"], {"math": 1.0, "code": 3.0, "logic": 0.5},
                 {"math": 1.0, "code": 3.0, "logic": 0.5}),
}


@pytest.mark.parametrize("preset", [*sorted(PRESETS), "tiny_cpu"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_each_form_on_each_preset(preset, form):
    overrides, on_paper, on_tiny = FORMS[form]
    assert mix(preset, *overrides) == (on_tiny if preset == "tiny_cpu" else on_paper)


def test_a_dict_replaces_a_preset_mix_rather_than_merging_into_it():
    assert mix("tiny_cpu") == {"math": 1.0}
    assert mix("tiny_cpu", "actor.sampler.weights={code:1}") == {"code": 1.0}  # math is gone, not kept at 1.0
    assert mix("apriel_15b", "actor.sampler.weights={math:1}") == {"math": 1.0}


@pytest.mark.parametrize("override, message", [
    ("actor.sampler.weights.science=0.2", "'science' is not in the mix .*add it with \\+actor.sampler.weights.science"),
    ("+actor.sampler.weights.code=0.3", "'code' is in the mix already; change it with actor.sampler.weights.code=0.3"),
    ("~actor.sampler.weights.science", "'science' is not in the mix"),
    ("actor.sampler.weights=null", "give the whole mix as a dict"),
    ("actor.sampler.weights.code=0.1,0.2", "the domain mix takes"),
    ("actor.sampler.weights.code.x=1", "the domain mix takes"),
    ("actor.sampler.weights={math:", "override 'actor.sampler.weights=\\{math:'"),
    ("actor.sampler.weights.code=abc", "actor.sampler.weights=.*'abc'.*Float"),
])
def test_an_override_that_does_not_fit_the_mix_is_refused_naming_it(override, message):
    with pytest.raises(ValueError, match=message) as err:
        compose_config("apriel_15b", [*CLUSTER, override])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("override, key", [
    ("actor.sampler.weights.code=0", "actor.sampler.weights.code=0.0"),
    ("actor.sampler.weights.code=-1", "actor.sampler.weights.code=-1.0"),
    ("actor.sampler.weights.code=inf", "actor.sampler.weights.code=inf"),
    ("actor.sampler.weights.code=nan", "actor.sampler.weights.code=nan"),
    ("actor.sampler.weights={math:1,code:-2}", "actor.sampler.weights.code=-2.0"),
])
def test_weights_not_positive_and_finite_are_refused_naming_the_key(override, key):
    with pytest.raises(ValueError, match=f"{key}: weights must be finite and > 0") as err:
        to_run_config(compose_config("apriel_15b", [*CLUSTER, override]))
    assert "\n" not in str(err.value)


def test_the_count_composes_and_is_validated():
    assert to_run_config(compose_config("tiny_cpu", [])).actor.sampler.count == "completed"
    assert to_run_config(compose_config("tiny_cpu", ["actor.sampler.count=trained"])).actor.sampler.count == "trained"
    with pytest.raises(ValueError, match="actor.sampler.count='kept'"):
        to_run_config(compose_config("tiny_cpu", ["actor.sampler.count=kept"]))

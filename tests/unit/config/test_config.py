"""Hydra composition: presets validate; unknown keys and bad values fail naming the key."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from megatron_apriel.config import RunConfig, register_configs, to_run_config

register_configs()
CONF = Path(__file__).resolve().parents[3] / "megatron_apriel" / "conf"


def compose_run(name: str, overrides=()):
    with initialize_config_module(config_module="megatron_apriel.conf", version_base=None):
        return compose(config_name=name, overrides=list(overrides))


def test_tiny_local_preset_builds_validated_dataclasses():
    run = to_run_config(compose_run("tiny_local", ["optim.lr=2e-3", "parallel.tp=2"]))
    assert isinstance(run, RunConfig)
    assert run.optim.lr == 2e-3 and run.parallel.tp == 2
    assert run.model.arch.vocab_size == 256  # from the YAML
    assert run.loss.kind == "gspo"  # from the dataclass default: YAML holds overrides only


def test_unknown_key_is_rejected_with_its_name():
    with pytest.raises((ConfigCompositionException, ConfigKeyError), match="lrr"):
        compose_run("tiny_local", ["optim.lrr=1e-3"])


def test_ill_typed_value_is_rejected_with_its_name():
    with pytest.raises((ConfigCompositionException, ValidationError), match="steps"):
        compose_run("tiny_local", ["trainer.steps=many"])


@pytest.mark.parametrize("override, message", [
    ("loss.kind=ppo", "loss.kind"),
    ("optim.lr=-1", "lr"),
    ("parallel.sequence_parallel=true", "sequence_parallel"),
    ("model.fp8=e5m2", "model.fp8"),
    ("rollout.group_size=1", "group_size"),
    ("rollout.max_lag=-1", "max_lag"),
    ("trainer.seq_len=16", "trainer.seq_len=16 cannot hold"),
])
def test_out_of_range_values_fail_with_the_fix(override, message):
    with pytest.raises(ValueError, match=message):
        to_run_config(compose_run("tiny_local", [override]))


@pytest.mark.parametrize("overrides, message", [
    (["parallel.cp=0"], "parallel.cp must be >= 1"),
    (["parallel.cp=2", "trainer.packing=false"], "parallel.cp=2 splits packed rows"),
    (["parallel.cp=2"], "rollout.source=local generates with the trainer's own model"),  # tiny_local is local
    (["parallel.cp=2", "rollout.source=fleet", "actor.max_prompt_tokens=64", "trainer.seq_len=126"],
     "set trainer.seq_len to a multiple of 4, e.g. 128"),
    (["parallel.cp=2", "rollout.source=fleet", "actor.max_prompt_tokens=64", "parallel.tp=2",
      "parallel.sequence_parallel=true", "trainer.seq_len=132"], "a multiple of 8, e.g. 136"),
])
def test_context_parallel_refusals_name_the_keys(overrides, message):
    with pytest.raises(ValueError, match=message):
        to_run_config(compose_run("tiny_local", ["model.hf_path=/m", *overrides]))


def test_paper_preset_composes_with_the_recipe_numbers():
    run = to_run_config(compose_run("apriel_15b", ["model.hf_path=/ckpt/apriel", "actor.data=[/data/math.jsonl]"]))
    assert run.loss.eps_low == 3e-3 and run.loss.eps_high == 4e-3 and run.optim.clip_grad == 0.1
    assert run.rollout.source == "fleet" and run.rollout.group_size == 8 and run.rollout.groups_per_step == 128
    assert run.rewards.max_len == 16000 and run.rewards.dap_enabled and run.rollout.max_lag is None
    assert run.optim.lr == 5e-7 and run.fleet.num_servers == 32 and run.actor.sampler.mix["math"] == 0.4


def test_paper_preset_says_what_is_missing():
    with pytest.raises(Exception, match="hf_path"):
        to_run_config(compose_run("apriel_15b", ["actor.data=[/data/math.jsonl]"]))


@pytest.mark.parametrize("name, tp, pp, servers", [("qwen25_32b", 8, 4, 16), ("llama3_70b", 8, 2, 8)])
def test_larger_base_presets_compose_on_the_recipe(name, tp, pp, servers):
    run = to_run_config(compose_run(name, ["model.hf_path=/m", "actor.data=[/d.jsonl]"]))
    assert (run.parallel.tp, run.parallel.pp, run.fleet.num_servers) == (tp, pp, servers)
    assert run.launch.nnodes * run.launch.nproc_per_node == 32 and run.rollout.group_size == 8
    assert run.loss.eps_low == 3e-3 and run.rewards.max_len == 16000  # the recipe, from the defaults


@pytest.mark.parametrize("name, seq_len, budget, layout, servers, nodes", [
    ("apriel_15b_32k", 36864, 32000, (8, 1, 1), 16, 4), ("qwen25_32b_64k", 65536, 61440, (8, 8, 1), 16, 8)])
def test_long_budget_presets_build_on_the_recipe(name, seq_len, budget, layout, servers, nodes):
    run = to_run_config(compose_run(name, ["model.hf_path=/m", "actor.data=[/d.jsonl]"]))
    assert (run.trainer.seq_len, run.rewards.max_len) == (seq_len, budget)
    assert (run.parallel.tp, run.parallel.cp, run.parallel.pp) == layout
    assert (run.fleet.num_servers, run.launch.nnodes) == (servers, nodes)
    assert run.trainer.seq_len >= run.actor.max_prompt_tokens + budget and run.loss.eps_low == 3e-3


def test_tiny_cpu_derives_its_paths_from_the_run_dir():
    run = to_run_config(compose_run("tiny_cpu", ["run_dir=/tmp/r"]))
    assert run.model.hf_path == "/tmp/r/base" and run.actor.data == ["/tmp/r/base/addition.jsonl"]
    with pytest.raises(ValueError, match="leave model.hf_path unset"):
        to_run_config(compose_run("tiny_cpu", ["model.hf_path=/elsewhere"]))


PRESETS = sorted(p.stem for p in (Path(__file__).resolve().parents[3] / "megatron_apriel" / "conf").glob("*.yaml"))


def _leaves(node, prefix=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], node


def _preset_defaults(raw: dict):
    """What a preset's keys would be without it: RunConfig's defaults under the presets it builds on."""
    merged = OmegaConf.structured(RunConfig)
    for parent in (p for p in raw.get("defaults", []) if isinstance(p, str) and p in PRESETS):
        parent_raw = OmegaConf.to_container(OmegaConf.load(CONF / f"{parent}.yaml"), resolve=False)
        merged = OmegaConf.merge(_preset_defaults(parent_raw),
                                 {k: v for k, v in parent_raw.items() if k not in ("defaults", "hydra")})
    return merged


@pytest.mark.parametrize("name", PRESETS)
def test_presets_hold_overrides_only(name):
    """A preset that restates a default hides where the value really comes from (and goes stale)."""
    raw = OmegaConf.to_container(OmegaConf.load(CONF / f"{name}.yaml"), resolve=False)
    defaults = _preset_defaults(raw)
    restated = [key for key, value in _leaves({k: v for k, v in raw.items() if k not in ("defaults", "hydra")})
                if OmegaConf.select(defaults, key, throw_on_missing=False) == value]
    assert not restated, f"{name}.yaml restates defaults: {restated}"


def test_every_preset_builds():
    cluster = ("apriel_15b", "qwen25_32b", "llama3_70b", "qwen3_30b_a3b", "qwen3_235b_a22b", "apriel_15b_32k",
               "qwen25_32b_64k")
    assert {"tiny_cpu", "tiny_local", "smoke_5domains", "tiny_moe_cpu", *cluster} <= set(PRESETS)
    for name in PRESETS:
        extra = ["model.hf_path=/m", "actor.data=[/d.jsonl]"] if name in cluster else []
        assert isinstance(to_run_config(compose_run(name, extra)), RunConfig)


def test_each_strategy_is_declared_once():
    """The trainer's builders cover exactly the rollout sources the config accepts, and a value
    outside a strategy's Literal is refused with the key."""
    from megatron_apriel.choices import RolloutSource, choices
    from megatron_apriel.entrypoints.trainer_rank import ROLLOUT_SOURCES
    from megatron_apriel.records.config import RolloutConfig

    assert tuple(ROLLOUT_SOURCES) == choices(RolloutSource)
    with pytest.raises(ValueError, match=r"rollout.source must be one of \('local', 'fleet', 'replay'\), got 'vllm'"):
        RolloutConfig(source="vllm")

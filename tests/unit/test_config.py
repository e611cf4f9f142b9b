"""Hydra composition: presets validate; unknown keys and bad values fail naming the key."""

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from megatron_apriel.config import RunConfig, register_configs, to_run_config

register_configs()


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
    ("rollout.local.group_size=1", "group_size"),
])
def test_out_of_range_values_fail_with_the_fix(override, message):
    with pytest.raises(ValueError, match=message):
        to_run_config(compose_run("tiny_local", [override]))


def test_paper_preset_composes_and_says_what_is_missing():
    cfg = compose_run("apriel_15b", ["model.hf_path=/ckpt/apriel"])
    assert cfg.loss.eps_low == 3e-3 and cfg.loss.eps_high == 4e-3 and cfg.optim.clip_grad == 0.1
    with pytest.raises(ValueError, match="rollout.source='fleet'"):
        to_run_config(cfg)

"""Bad input to apriel-convert: a clear error naming the file / tensor and the fix, and nothing
left at --out (nor a scratch directory next to it)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_apriel.convert.checkpoint import hf_to_mcore, mcore_to_hf, staging_dir
from megatron_apriel.entrypoints.convert import main


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=250, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=12, sliding_window=None)
    path = tmp_path_factory.mktemp("errors") / "hf"
    MistralForCausalLM(cfg).save_pretrained(path, max_shard_size="40KB")
    return path


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _assert_nothing_written(out: Path) -> None:
    assert not out.exists(), f"{out} was created"
    assert not list(out.parent.glob(f".{out.name}*")), "scratch / partial directories left behind"


def _shard_of(path: Path, key: str) -> Path:
    return path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][key]


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unknown_architecture(hf_dir, tmp_path):
    src = _copy(hf_dir, tmp_path / "src")
    _edit_config(src, model_type="gpt2")
    with pytest.raises(ValueError, match="unsupported HF model_type 'gpt2'"):
        hf_to_mcore(src, tmp_path / "out", progress=False)
    _assert_nothing_written(tmp_path / "out")


def test_missing_shard_file_is_named(hf_dir, tmp_path):
    src = _copy(hf_dir, tmp_path / "src")
    shard = _shard_of(src, "model.layers.1.mlp.down_proj.weight")
    shard.unlink()
    with pytest.raises(ValueError, match=f"missing.*{shard.name}"):
        hf_to_mcore(src, tmp_path / "out", progress=False)
    _assert_nothing_written(tmp_path / "out")


def test_truncated_shard_file_is_named(hf_dir, tmp_path):
    src = _copy(hf_dir, tmp_path / "src")
    shard = _shard_of(src, "model.layers.0.self_attn.q_proj.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=f"{shard.name} is truncated"):
        hf_to_mcore(src, tmp_path / "out", progress=False)
    _assert_nothing_written(tmp_path / "out")


def test_tensor_missing_from_checkpoint_is_named(hf_dir, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(hf_dir / "config.json", src / "config.json")
    tensors = {}
    for f in hf_dir.glob("*.safetensors"):
        tensors.update(load_file(f))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, src / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        hf_to_mcore(src, tmp_path / "out", progress=False)
    _assert_nothing_written(tmp_path / "out")


def test_tp_not_dividing_heads(hf_dir, tmp_path):
    with pytest.raises(ValueError, match="tp=3 must divide"):
        hf_to_mcore(hf_dir, tmp_path / "out", tp=3, progress=False)
    _assert_nothing_written(tmp_path / "out")


def test_config_weights_shape_mismatch_names_tensor_and_file(hf_dir, tmp_path):
    src = _copy(hf_dir, tmp_path / "src")
    _edit_config(src, intermediate_size=64)
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight in model-\d+-of-\d+\.safetensors has shape"):
        hf_to_mcore(src, tmp_path / "out", progress=False)
    _assert_nothing_written(tmp_path / "out")


def test_cli_reports_errors_with_exit_code_2(hf_dir, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    with pytest.raises(SystemExit) as exc:
        main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(tmp_path / "out"), "--no-progress"])
    assert exc.value.code == 2 and "already exists" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["mcore-to-hf", "--mcore", str(hf_dir), "--out", str(tmp_path / "x"), "--no-progress"])
    assert "not a Megatron distributed checkpoint" in capsys.readouterr().err
    _assert_nothing_written(tmp_path / "x")


def test_export_refuses_a_reference_of_another_model(hf_dir, tmp_path):
    hf_to_mcore(hf_dir, tmp_path / "mc", progress=False)
    other = _copy(hf_dir, tmp_path / "other")
    _edit_config(other, num_hidden_layers=3)
    with pytest.raises(ValueError, match="num_layers"):
        mcore_to_hf(tmp_path / "mc", tmp_path / "back", hf_reference=other, progress=False)
    _assert_nothing_written(tmp_path / "back")


def test_failure_midway_removes_the_partial_output(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"):
        with staging_dir(out) as tmp:
            (tmp / "model-00001-of-00002.safetensors").write_bytes(b"half")
            raise RuntimeError("boom")
    _assert_nothing_written(out)

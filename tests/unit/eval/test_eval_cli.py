"""apriel-eval's bad input: clear errors (exit 2) before anything is served or written."""

import pytest

from megatron_apriel.entrypoints.eval import main
from megatron_apriel.eval.benchmarks import FORMATS
from tests.eval_fixtures import write_aime


def run(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(["run", *argv])
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.fixture
def aime(tmp_path):
    return write_aime(tmp_path / "aime.jsonl")


def test_unknown_format(tmp_path, aime, capsys):
    err = run(capsys, "--checkpoint", str(tmp_path), "--out", str(tmp_path / "out"), "--bench", f"a:aime2025:{aime}")
    assert f"unknown format 'aime2025'; use one of {FORMATS}" in err and "bfcl_multi_turn" in err
    assert not (tmp_path / "out").exists()


def test_missing_benchmark_file(tmp_path, aime, capsys):
    err = run(capsys, "--checkpoint", str(tmp_path), "--out", str(tmp_path / "out"), "--bench", f"a:aime:{aime}",
              "--bench", f"g:gpqa:{tmp_path / 'gpqa.csv'}")
    assert f"benchmark g: {tmp_path / 'gpqa.csv'}: no such file" in err
    assert not (tmp_path / "out").exists()


def test_malformed_benchmark_row(tmp_path, capsys):
    bad = tmp_path / "aime.jsonl"
    bad.write_text('{"problem": "1 + 1?", "answer": "2"}\n{"problem": "no answer"}\n')
    err = run(capsys, "--checkpoint", str(tmp_path), "--out", str(tmp_path / "out"), "--bench", f"a:aime:{bad}")
    assert f"{bad}: row 2: not in aime format" in err


def test_missing_or_unrecognised_checkpoint(tmp_path, aime, capsys):
    err = run(capsys, "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "out"),
              "--bench", f"a:aime:{aime}")
    assert f"checkpoint {tmp_path / 'nope'}: no such directory" in err and not (tmp_path / "out").exists()
    (tmp_path / "empty").mkdir()
    err = run(capsys, "--checkpoint", str(tmp_path / "empty"), "--out", str(tmp_path / "out"),
              "--bench", f"a:aime:{aime}")
    assert "neither an HF model directory (no config.json) nor a Megatron dist checkpoint" in err
    dist = tmp_path / "ckpt" / "dist"
    dist.mkdir(parents=True)
    (dist / "metadata.json").write_text("{}")
    err = run(capsys, "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out2"),
              "--bench", f"a:aime:{aime}")
    assert "no HF reference was found for its config and tokenizer: pass --hf-reference" in err


def test_bad_options(tmp_path, aime, capsys):
    common = ["--checkpoint", str(tmp_path), "--out", str(tmp_path / "out"), "--bench", f"a:aime:{aime}"]
    assert "--n-for 'b=2': write NAME=N with NAME one of ['a']" in run(capsys, *common, "--n-for", "b=2")
    assert "benchmark names must be unique" in run(capsys, *common, "--bench", f"a:aime:{aime}")
    assert "--budgets '4k': write comma-separated token counts" in run(capsys, *common, "--budgets", "4k")
    assert "temperature must be >= 0" in run(capsys, *common, "--temperature", "-1")


def test_each_started_server_sees_its_own_gpus(tmp_path, aime, capsys):
    from megatron_apriel.eval.serving import server_env

    assert server_env(0, 0) == {} and server_env(3, 0) == {}
    assert [server_env(i, 2)["CUDA_VISIBLE_DEVICES"] for i in range(4)] == ["0,1", "2,3", "4,5", "6,7"]
    common = ["--checkpoint", str(tmp_path), "--out", str(tmp_path / "out"), "--bench", f"a:aime:{aime}"]
    assert "--gpus-per-server >= 0" in run(capsys, *common, "--gpus-per-server", "-1")

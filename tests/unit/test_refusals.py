"""Every command refuses bad input the same way, through its real command line: exit code 2, one
line on stderr (``<command>: error: ...``) naming the key, preset or file, and no traceback."""

import shutil
import subprocess

import pytest

from tests.unit.conftest import launcher_env

pytestmark = pytest.mark.integration  # its tests start our commands

CASES = {
    "train: unknown key": (["apriel-train", "--config-name", "tiny_cpu", "trainer.stepz=3"], "apriel-train: error:",
                           "trainer.stepz"),
    "train: ill-typed value": (["apriel-train", "trainer.steps=many"], "apriel-train: error:", "trainer.steps=many"),
    "train: no such preset": (["apriel-train", "--config-name=apriel_16b"], "apriel-train: error:", "tiny_cpu"),
    "train: bad override syntax": (["apriel-train", "trainer.steps=["], "apriel-train: error:", "'trainer.steps=['"),
    "train: mix domain not in the mix": (["apriel-train", "actor.sampler.weights.code=0.3"], "apriel-train: error:",
                                         "+actor.sampler.weights.code=0.3"),
    "train: mix weight not positive": (["apriel-train", "actor.sampler.weights={{math:1,code:0}}"],  # {{}}: format()
                                       "apriel-train: error:", "actor.sampler.weights.code=0.0"),
    "train: mix not a dict": (["apriel-train", "actor.sampler.weights=0.5"], "apriel-train: error:",
                              "actor.sampler.weights=0.5"),
    "train: a flag it does not take": (["apriel-train", "--cfg", "job", "actor.sampler.weights.math=2"],
                                         "apriel-train: error:", "launch.dry_run=true"),
    "submit: unknown key": (["apriel-submit", "--config-name", "tiny_cpu", "slurm.partitoin=gpu", "--dry-run"],
                            "apriel-submit: error:", "slurm.partitoin"),
    "plan: unknown key": (["apriel-plan", "--preset", "apriel_15b", "--override", "fleet.num_serverz=2",
                           "--nodes", "2", "--gpus-per-node", "8", "--gpu-memory-gb", "80"],
                          "apriel-plan: error:", "fleet.num_serverz"),
    "convert: not an HF model": (["apriel-convert", "hf-to-mcore", "--hf", "{tmp}/nothing", "--out", "{tmp}/out"],
                                 "apriel-convert hf-to-mcore: error:", "{tmp}/nothing/config.json"),
    "convert: not a checkpoint": (["apriel-convert", "mcore-to-hf", "--mcore", "{tmp}", "--out", "{tmp}/out"],
                                  "apriel-convert mcore-to-hf: error:", "metadata.json"),
    "eval: no such file": (["apriel-eval", "run", "--checkpoint", "{tmp}", "--bench", "a:aime:{tmp}/aime.jsonl",
                            "--out", "{tmp}/out"], "apriel-eval run: error:", "{tmp}/aime.jsonl"),
    "eval: unknown format": (["apriel-eval", "run", "--checkpoint", "{tmp}", "--bench", "a:aimee:{tmp}/a.jsonl",
                              "--out", "{tmp}/out"], "apriel-eval run: error:", "'aimee'"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_refusal_is_one_line_and_exit_code_2(case, tmp_path):
    argv, prefix, names = CASES[case]
    argv = [shutil.which(argv[0]), *(a.format(tmp=tmp_path) for a in argv[1:])]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=launcher_env(), cwd=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith(prefix) and names.format(tmp=tmp_path) in lines[0], lines[0]


DEBUG_CASES = ("train: unknown key", "submit: unknown key", "plan: unknown key", "convert: not a checkpoint",
               "eval: unknown format")
"""One refusal per command: with APRIEL_DEBUG=1 each shows its traceback instead (megatron_apriel.refusals)."""


@pytest.mark.parametrize("case", DEBUG_CASES)
def test_apriel_debug_shows_the_refusals_traceback(case, tmp_path):
    argv, _, names = CASES[case]
    argv = [shutil.which(argv[0]), *(a.format(tmp=tmp_path) for a in argv[1:])]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=dict(launcher_env(), APRIEL_DEBUG="1"))
    assert proc.returncode not in (0, 2), proc.stderr[-3000:]
    assert "Traceback (most recent call last)" in proc.stderr and names.format(tmp=tmp_path) in proc.stderr

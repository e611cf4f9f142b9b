"""The launcher refuses bad input before anything starts, and its dry run describes the paper's run."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_apriel.tiny.model import build_tiny_model
from tests.unit.conftest import launcher_env

pytestmark = pytest.mark.integration  # its tests start processes of their own

MISTRAL_TEXT = {"model_type": "mistral", "vocab_size": 131072, "hidden_size": 5120, "intermediate_size": 14336,
                "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                "rope_theta": 1e9, "rms_norm_eps": 1e-5, "hidden_act": "silu", "sliding_window": None,
                "tie_word_embeddings": False, "max_position_embeddings": 131072}


def apriel_train(*args, cwd):
    return subprocess.run([shutil.which("apriel-train"), *args], capture_output=True, text=True, timeout=300,
                          env=launcher_env(), cwd=cwd)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def fleet_run(tmp_path, model_dir, *extra):
    run = tmp_path / "run"
    proc = apriel_train("--config-name", "tiny_cpu", f"run_dir={run}", "tiny_base.enabled=false",
                        f"model.hf_path={model_dir}", *extra, cwd=tmp_path)
    return proc, run


def test_a_malformed_data_row_is_named_and_nothing_starts(tmp_path, model_dir):
    good = {"id": "m1", "domain": "math", "prompt": [{"role": "user", "content": "1+1?"}], "reference": "\"2\"",
            "metadata": "{}"}
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(good) + "\n" + '{"id": "m2", "domain": "math", "prompt": [}\n')
    proc, run = fleet_run(tmp_path, model_dir, f"actor.data=[{data}]")
    assert proc.returncode == 2
    assert f"{data}:2" in proc.stderr and "invalid JSON" in proc.stderr
    assert not (run / "logs").exists()  # no server, actor or trainer was started


def test_a_domain_without_problems_is_refused(tmp_path, model_dir):
    data = tmp_path / "math.jsonl"
    row = {"id": "m1", "domain": "math", "prompt": [{"role": "user", "content": "1+1?"}], "reference": "\"2\"",
           "metadata": "{}"}
    data.write_text(json.dumps(row) + "\n")
    proc, run = fleet_run(tmp_path, model_dir, f"actor.data=[{data}]", "+actor.sampler.weights.code=0.5")
    assert proc.returncode == 2 and "['code'] have weight > 0" in proc.stderr and not (run / "logs").exists()


def test_inconsistent_budgets_are_refused(tmp_path, model_dir):
    proc, run = fleet_run(tmp_path, model_dir, "trainer.seq_len=80", "rewards.max_len=24", "actor.max_prompt_tokens=64")
    assert proc.returncode != 0 and "trainer.seq_len=80 cannot hold" in proc.stderr
    proc, run = fleet_run(tmp_path, model_dir, "fleet.vllm_args=[--max-model-len,32]")
    assert proc.returncode == 2 and "--max-model-len 32 < actor.max_prompt_tokens" in proc.stderr


def text_params(c):
    """The text decoder's parameter count from its config, by hand: embeddings, 48 x (attention,
    SwiGLU MLP, 2 norms), final norm, untied output layer."""
    h, f, layers, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    return v * h + layers * (h * q + 2 * h * kv + q * h + 3 * h * f + 2 * h) + h + v * h


REPO = Path(__file__).resolve().parents[3]
FIVE_DOMAINS = [REPO / "examples" / "data" / f"{d}.jsonl"
                for d in ("math", "code", "logic", "ifeval", "function_calling")]


def apriel_model(tmp_path) -> Path:
    model = tmp_path / "apriel"
    model.mkdir()
    config = {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"], "text_config": MISTRAL_TEXT,
              "vision_config": {"model_type": "pixtral"}}
    (model / "config.json").write_text(json.dumps(config))
    return model


def data_list(files) -> str:
    return "actor.data=[" + ",".join(str(f) for f in files) + "]"


def test_dry_run_describes_the_paper_recipe(tmp_path):
    model = apriel_model(tmp_path)
    proc = apriel_train("--config-name", "apriel_15b", f"model.hf_path={model}", data_list(FIVE_DOMAINS),
                        "launch.dry_run=true", f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "launch.dry_run" not in out  # the printed commands are the ones the launch would run
    assert "the launch would refuse: launch.nnodes=4" in out
    assert f"{text_params(MISTRAL_TEXT) / 1e9:.2f}B parameters" in out and "48 layers" in out
    assert "4 node(s) x 8 rank(s) = TP 4 x PP 1 x DP 8" in out and "250 steps of 128 groups x G=8" in out
    assert sum(line.strip().startswith("server_") for line in out.splitlines()) == 32
    assert "--max-model-len 20096" in out and "budget 16000 tokens" in out and "max_lag None" in out
    assert not (tmp_path / "run" / "logs").exists()  # a dry run starts nothing


def test_dry_run_refuses_what_the_launch_refuses_in_one_line(tmp_path):
    model = apriel_model(tmp_path)
    proc = apriel_train("--config-name", "apriel_15b", f"model.hf_path={model}", data_list(FIVE_DOMAINS[:2]),
                        "launch.dry_run=true", f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 2 and "['logic', 'ifeval', 'function_calling'] have weight > 0" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""  # no plan for a launch that would refuse
    proc = apriel_train("--config-name", "apriel_15b", data_list(FIVE_DOMAINS), "launch.dry_run=true",
                        f"run_dir={tmp_path / 'run'}", cwd=tmp_path)  # no model.hf_path: a config error
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()  # one line: no Hydra banner, no traceback
    assert line.startswith("apriel-train: error: ") and "set model.hf_path" in line


QWEN3_30B = REPO / "megatron_apriel" / "conf" / "models" / "qwen3_30b_a3b"
MIX_FORMS = {  # docs/configuration.md's three forms, each on the paper's mix; the dry run prints the mix it gives
    "whole": (["actor.sampler.weights={math:0.6,code:0.4}"], {"math": 0.6, "code": 0.4}),
    "change": (["actor.sampler.weights.code=0.3"], {"math": 0.4, "code": 0.3, "logic": 0.15, "ifeval": 0.1,
                                                    "function_calling": 0.1}),
    "add": (["actor.sampler.weights={math:0.5}", "+actor.sampler.weights.logic=0.5"], {"math": 0.5, "logic": 0.5}),
}


def dry_run(tmp_path, preset, *overrides):
    model = {"apriel_15b": lambda: apriel_model(tmp_path), "qwen3_30b_a3b": lambda: QWEN3_30B}.get(preset)
    extra = [f"model.hf_path={model()}"] if model else []
    return apriel_train("--config-name", preset, *extra, data_list(FIVE_DOMAINS), "launch.dry_run=true",
                        f"run_dir={tmp_path / 'run'}", *overrides, cwd=tmp_path)


@pytest.mark.parametrize("preset", ["apriel_15b", "qwen3_30b_a3b", "smoke_5domains"])
@pytest.mark.parametrize("form", sorted(MIX_FORMS))
def test_the_dry_run_prints_the_mix_each_override_form_gives(tmp_path, preset, form):
    overrides, expected = MIX_FORMS[form]
    proc = dry_run(tmp_path, preset, *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"mix {expected} (actor.sampler.count=completed)" in proc.stdout, proc.stdout
    assert proc.stdout.count(f"--run-dir {tmp_path}") >= 2  # actor and trainer read the config the launch saves


def test_the_dry_run_refuses_a_mix_domain_without_data_and_a_bad_weight_in_one_line(tmp_path):
    proc = dry_run(tmp_path, "smoke_5domains", "+actor.sampler.weights.science=0.2")
    assert proc.returncode == 2 and "['science'] have weight > 0 in actor.sampler.weights" in proc.stderr
    proc = dry_run(tmp_path, "apriel_15b", "actor.sampler.weights.code=-1")
    [line] = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and line.startswith("apriel-train: error: actor.sampler.weights.code=-1.0")


def test_stopping_a_crashed_component_kills_what_is_left_of_its_process_group(tmp_path):
    import os
    import time

    from megatron_apriel.launch.components import Component

    pid_file = tmp_path / "child.pid"  # like vLLM's engine core, left behind by its dead API server
    c = Component("server_0", ["bash", "-c", f"sleep 300 & echo $! > {pid_file}; exit 3"], tmp_path / "s.log")
    c.start()
    assert c.proc.wait(30) == 3
    child = int(pid_file.read_text())
    os.kill(child, 0)  # alive: the leader's death did not take it along
    c.stop()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and "Z" not in Path(f"/proc/{child}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline, "the orphaned child survived stop()"
        time.sleep(0.05)


def test_stopping_a_component_kills_descendants_that_left_its_process_group(tmp_path):
    import os
    import time

    from megatron_apriel.launch.components import Component

    # like torchrun's ranks: a child in a session of its own, ignoring SIGTERM (stuck in a collective)
    pid_file = tmp_path / "rank.pid"
    script = f"setsid bash -c 'trap \"\" TERM; echo $$ > {pid_file}; sleep 300' & wait"
    c = Component("trainer", ["bash", "-c", script], tmp_path / "t.log")
    c.start()
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    rank = int(pid_file.read_text())
    assert os.getpgid(rank) != os.getpgid(c.proc.pid)  # out of the group: killpg alone misses it
    c.stop(grace_s=2)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{rank}").exists() and "Z" not in Path(f"/proc/{rank}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline, "the rank in its own session survived stop()"
        time.sleep(0.05)


def test_after_the_trainer_the_other_components_stop_together(tmp_path):
    """Each of two components exits on SIGTERM only once the other has had its SIGTERM too: stopped
    one after the other, the first would wait out its grace and be killed."""
    import time

    from hydra import compose, initialize_config_module

    from megatron_apriel.config import register_configs, to_run_config
    from megatron_apriel.launch.components import Component
    from megatron_apriel.launch.local import Launcher

    register_configs()
    with initialize_config_module(config_module="megatron_apriel.conf", version_base=None):
        run = to_run_config(compose(config_name="tiny_local", overrides=[f"run_dir={tmp_path}"]))

    def script(name: str, then: str) -> list[str]:
        mine, other = tmp_path / f"{name}.term", tmp_path / f"{other_of[name]}.term"
        on_term = f"touch {mine}; {then.format(other=other)}"
        return ["bash", "-c", f"trap '{on_term}' TERM; touch {tmp_path / name}.ready; while :; do sleep 0.05; done"]

    other_of = {"actor": "server_0", "server_0": "actor", "trainer": "actor"}
    wait_other = "while [ ! -e {other} ]; do sleep 0.05; done; exit 0"
    comps = [Component("server_0", script("server_0", wait_other), tmp_path / "s.log"),
             Component("actor", script("actor", wait_other), tmp_path / "a.log"),
             Component("trainer", script("trainer", "exit 0"), tmp_path / "t.log")]
    launcher = Launcher(run, comps)
    for c in comps:
        c.start()
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"{c.name}.ready").exists() for c in comps):
        assert time.monotonic() < deadline, "the components did not start"
        time.sleep(0.05)
    launcher.stop_all()
    assert [c.proc.returncode for c in comps] == [0, 0, 0]  # none had to be killed


def test_a_failed_trainers_report_names_the_ranks_exception_above_torchruns_summary(tmp_path):
    """torchrun prefixes each line of a rank's output with ``[rankN]: `` and ends the log with its own
    summary, whose last lines do not say what failed: the report must lift the rank's exception."""
    from megatron_apriel.launch.components import Component

    log = tmp_path / "trainer.log"
    log.write_text("\n".join([
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "x.py", line 1, in f',
        "[rank0]: OSError: [Errno 28] No space left on device",
        "[rank1]: RuntimeError: Connection closed by peer",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        *(f"  summary line {i}" for i in range(40)),
    ]))
    report = Component("trainer", ["true"], log).tail().splitlines()
    assert report[:3] == ["errors reported:", "  [rank0]: OSError: [Errno 28] No space left on device",
                          "  [rank1]: RuntimeError: Connection closed by peer"]
    assert report[3] == "last lines:" and report[-1] == "  summary line 39"

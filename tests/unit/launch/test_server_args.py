"""``fleet.vllm_args`` read in one place (``ServerArgs``): both spellings of a flag, defaults that
never override what the user gave, and the run's context length checked against it."""

import pytest

from megatron_apriel.config import to_run_config
from megatron_apriel.entrypoints.serve import advertised_url, build_command
from megatron_apriel.fleet.config import ServerArgs
from megatron_apriel.launch.components import server_flags
from tests.unit.config.test_config import compose_run


def test_both_spellings_and_the_defaults_of_vllm():
    spaced = ServerArgs(("--max-model-len", "512", "-tp", "2", "--gpu-memory-utilization", "0.5", "--port", "9"))
    joined = ServerArgs(("--max-model-len=512", "--tensor-parallel-size=2", "--gpu-memory-utilization=0.5", "--port=9"))
    for args in (spaced, joined):
        assert (args.max_model_len, args.tensor_parallel_size, args.gpu_memory_utilization, args.port) == \
            (512, 2, 0.5, 9)
    empty = ServerArgs()
    assert (empty.max_model_len, empty.tensor_parallel_size, empty.gpu_memory_utilization, empty.host, empty.port) == \
        (None, 1, 0.9, "0.0.0.0", 8000)


def test_a_default_is_added_only_when_the_flag_is_absent():
    args = ServerArgs(("--seed=7",))
    assert args.with_default("--seed", "1").argv == ("--seed=7",)
    assert args.with_default("--enforce-eager").with_default("--max-model-len", "64").argv == \
        ("--seed=7", "--enforce-eager", "--max-model-len", "64")
    cmd, _ = build_command(["--dtype=bfloat16", "--enforce-eager"], backend="gloo", on_gpu=False)
    assert cmd.count("--enforce-eager") == 1 and "--dtype=bfloat16" in cmd and "float32" not in cmd
    assert advertised_url(["--host=10.0.0.2", "--port", "8100"], None) == "http://10.0.0.2:8100"


@pytest.mark.parametrize("given", [["--max-model-len", "32"], ["--max-model-len=32"]])
def test_the_run_refuses_a_context_shorter_than_prompt_plus_budget(given):
    run = to_run_config(compose_run("tiny_local", ["fleet.vllm_args=[" + ",".join(f"'{a}'" for a in given) + "]"]))
    with pytest.raises(ValueError, match="--max-model-len 32 < actor.max_prompt_tokens"):
        server_flags(run)
    ok = to_run_config(compose_run("tiny_local"))
    flags = ServerArgs(tuple(server_flags(ok)))
    assert flags.max_model_len == ok.actor.max_prompt_tokens + ok.rewards.max_len \
        and flags.value("--seed") == str(ok.seed)
    # multi-turn: a trajectory's later turns see the prompt and every earlier turn's tokens
    turns = to_run_config(compose_run("tiny_local", ["actor.max_trajectory_tokens=300", "trainer.seq_len=512"]))
    assert ServerArgs(tuple(server_flags(turns))).max_model_len == turns.actor.max_prompt_tokens + 300
    short = f"fleet.vllm_args=[--max-model-len,{ok.actor.max_prompt_tokens + 299}]"
    with pytest.raises(ValueError, match="actor.max_prompt_tokens \\+ actor.max_trajectory_tokens"):
        server_flags(to_run_config(compose_run("tiny_local", ["actor.max_trajectory_tokens=300", "trainer.seq_len=512",
                                                              short])))


def test_routed_experts_are_vllms_option_on_gpu_and_our_capture_on_cpu():
    gpu, env = build_command(["--model", "m"], backend="apriel_nccl", on_gpu=True, routed_experts=True)
    assert "--enable-return-routed-experts" in gpu and env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert gpu[2] == "vllm.entrypoints.launchers.api_server.entry"
    cpu, env = build_command(["--model", "m"], backend="gloo", on_gpu=False, routed_experts=True)
    assert cpu[2] == "megatron_apriel.serving.launch" and env["APRIEL_CAPTURE_ROUTED_EXPERTS"] == "1"
    assert "--no-enable-prefix-caching" in cpu and "--enable-return-routed-experts" not in cpu
    plain, env = build_command(["--model", "m"], backend="gloo", on_gpu=False)
    assert plain[2] == "megatron_apriel.serving.launch" and "APRIEL_CAPTURE_ROUTED_EXPERTS" not in env
    on_gpu, _ = build_command(["--model", "m"], backend="apriel_nccl", on_gpu=True)
    assert on_gpu[2] == "vllm.entrypoints.launchers.api_server.entry"
    with pytest.raises(ValueError, match="needs prefix caching"):
        build_command(["--no-enable-prefix-caching"], backend="apriel_nccl", on_gpu=True, routed_experts=True)
    with pytest.raises(ValueError, match="drop --enable-prefix-caching"):
        build_command(["--enable-prefix-caching"], backend="gloo", on_gpu=False, routed_experts=True)


def test_a_moe_fleet_is_asked_for_its_routed_experts():
    moe = to_run_config(compose_run("tiny_moe_cpu"))
    assert "--return-routed-experts" in server_flags(moe)
    assert "--return-routed-experts" not in server_flags(to_run_config(compose_run("tiny_cpu")))


def test_per_server_flags_go_to_their_server_only_and_last():
    from megatron_apriel.config import compose_config
    from megatron_apriel.launch.components import components

    run = to_run_config(compose_config("tiny_cpu", ["fleet.num_servers=3", "fleet.vllm_args=[--dtype,float32]",
                                                    "fleet.per_server_vllm_args=[[],[--dtype,bfloat16,-n,64]]"]))
    cmds = {c.name: c.cmd for c in components(run)}
    # after the fleet's own --dtype (vLLM takes the last); a bare number arrives as a string, as in vllm_args
    assert cmds["server_1"][-4:] == ["--dtype", "bfloat16", "-n", "64"]
    assert "bfloat16" not in cmds["server_0"] and "bfloat16" not in cmds["server_2"]
    assert server_flags(run, 1)[-4:] == ["--dtype", "bfloat16", "-n", "64"]
    assert server_flags(run) == server_flags(run, 0)


@pytest.mark.parametrize("overrides, match", [
    (["fleet.num_servers=1", "fleet.per_server_vllm_args=[[],[--dtype,bfloat16]]"], "2 entries for the 1 server"),
    (["fleet.num_servers=2", "fleet.per_server_vllm_args=[[],[-tp,2]]"], r"\[1\] sets a parallel"),
    (["fleet.servers=[http://a:1]", "fleet.per_server_vllm_args=[[--dtype,bfloat16]]"], "none with fleet.servers"),
])
def test_per_server_flags_that_cannot_apply_are_refused(overrides, match):
    from megatron_apriel.config import compose_config

    with pytest.raises(ValueError, match=match):
        to_run_config(compose_config("tiny_cpu", overrides))


def test_without_drops_a_flag_in_each_spelling_with_its_value():
    args = ServerArgs(("--max-model-len", "512", "-tp", "2", "--tensor-parallel-size=4", "--enforce-eager"))
    assert args.without("--tensor-parallel-size", "-tp").argv == ("--max-model-len", "512", "--enforce-eager")

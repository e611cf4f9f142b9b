"""SLURM task variables -> torch.distributed's, in the one place that maps them (parallel/launcher_env.py).

The values below are what SLURM 22.05 set in a real ``srun -N2 -n3`` step and in a batch script
(tools/setup_slurm.sh cluster); tests/slurm runs the mapping under a real srun.
"""

import pytest

from megatron_apriel.parallel.launcher_env import tasks_per_node, trainer_rank_env

STEP = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "3", "SLURM_STEP_NUM_TASKS": "3",
        "SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_TASKS_PER_NODE": "2,1"}


def task(procid, nodeid, localid, **extra):
    return {**STEP, "SLURM_PROCID": str(procid), "SLURM_NODEID": str(nodeid), "SLURM_LOCALID": str(localid),
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "23456", **extra}


def test_each_srun_task_becomes_its_rank():
    got = [trainer_rank_env(task(*t)) for t in [(0, 0, 0), (1, 0, 1), (2, 1, 0)]]
    assert [g["RANK"] for g in got] == ["0", "1", "2"]
    assert {g["WORLD_SIZE"] for g in got} == {"3"}
    assert [g["LOCAL_RANK"] for g in got] == ["0", "1", "0"]
    assert [g["LOCAL_WORLD_SIZE"] for g in got] == ["2", "2", "1"]
    assert [g["NODE_RANK"] for g in got] == ["0", "0", "1"]
    assert {(g["MASTER_ADDR"], g["MASTER_PORT"]) for g in got} == {("10.0.0.1", "23456")}


def test_step_task_count_wins_over_the_jobs():
    # a het group's step: the job has more tasks than the trainer's step
    env = task(1, 0, 1, SLURM_NTASKS="5", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_TASKS_PER_NODE="2")
    assert trainer_rank_env(env)["WORLD_SIZE"] == "2" and trainer_rank_env(env)["LOCAL_WORLD_SIZE"] == "2"


def test_torchrun_variables_are_left_alone():
    assert trainer_rank_env({**task(2, 1, 0), "RANK": "5", "WORLD_SIZE": "8"}) == {}


def test_the_batch_script_and_a_plain_shell_are_not_ranks():
    batch = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "3", "MASTER_ADDR": "x", "MASTER_PORT": "1"}
    assert trainer_rank_env(batch) is None  # no SLURM_STEP_ID in a batch script
    assert trainer_rank_env({}) is None


def test_a_one_task_step_without_rendezvous_is_the_local_launcher():
    env = {k: v for k, v in task(0, 0, 0, SLURM_NTASKS="1", SLURM_STEP_NUM_TASKS="1").items()
           if not k.startswith("MASTER_")}
    assert trainer_rank_env(env) is None


def test_several_tasks_without_rendezvous_fail_with_the_fix():
    env = {k: v for k, v in task(1, 0, 1).items() if not k.startswith("MASTER_")}
    with pytest.raises(ValueError, match="MASTER_ADDR/MASTER_PORT are not set"):
        trainer_rank_env(env)


def test_compressed_tasks_per_node():
    assert tasks_per_node("8(x4),2") == [8, 8, 8, 8, 2]
    assert tasks_per_node("3") == [3]
    with pytest.raises(ValueError, match="cannot parse"):
        tasks_per_node("8x4")

"""apriel-submit refuses bad settings before submitting, each time naming what to change; and the
script it renders is a valid sbatch script for the layout (resources before the first command)."""

import re
import shlex
import sys
from pathlib import Path

import pytest

from megatron_apriel.config import compose_run
from megatron_apriel.entrypoints import submit as submit_cli
from megatron_apriel.slurm import checks
from megatron_apriel.slurm.layout import job_layout
from megatron_apriel.slurm.render import render, shipped

CPU = ["slurm.gpus_per_node=0", "slurm.servers_per_node=1"]
GPU = ["slurm.gpus_per_node=8", "slurm.servers_per_node=0", "launch.nproc_per_node=8",
       "fleet.num_servers=8"]  # servers per node 0: from the servers' -tp


def layout_of(*overrides):
    run, _ = compose_run("tiny_cpu", list(overrides))
    return run, job_layout(run)


def refusal(*overrides) -> str:
    with pytest.raises(ValueError) as err:
        layout_of(*overrides)
    return str(err.value)


def test_ranks_per_node_must_match_gpus_per_node():
    msg = refusal("slurm.gpus_per_node=8", "launch.nproc_per_node=4")
    assert "set launch.nproc_per_node=8" in msg


def test_tp_times_pp_must_divide_the_trainer_gpus():
    msg = refusal(*GPU, "parallel.tp=4", "parallel.pp=4")
    assert "parallel.tp x parallel.pp = 4 x 4" in msg and "multiple of 16" in msg
    layout_of(*GPU, "launch.nnodes=2", "parallel.tp=4", "parallel.pp=4")  # 16 GPUs: fits


def test_tp_must_stay_inside_a_node():
    msg = refusal("slurm.gpus_per_node=6", "launch.nproc_per_node=6", "launch.nnodes=4", "parallel.tp=4")
    assert "parallel.tp=4 must divide slurm.gpus_per_node=6" in msg


def test_servers_must_fill_whole_rollout_nodes():
    msg = refusal(*GPU, "fleet.num_servers=10", "fleet.vllm_args=[--tensor-parallel-size,2]")  # 4 per node
    assert "use 8 or 12" in msg and "slurm.servers_per_node" in msg


def test_server_gpus_must_fit_a_node():
    msg = refusal(*GPU, "slurm.servers_per_node=8", "fleet.num_servers=8", "fleet.vllm_args=[-tp,2]")
    assert "need 16 GPUs per node, the nodes have 8" in msg


def test_layout_counts_the_nodes_of_both_components():
    _, layout = layout_of(*GPU, "launch.nnodes=4", "fleet.num_servers=16", "fleet.vllm_args=[-tp,2]")
    assert (layout.train_nodes, layout.rollout_nodes, layout.servers_per_node, layout.total_nodes) == (4, 4, 4, 8)


def test_checkpoint_at_end_is_required():
    assert "set checkpoint.save_at_end=true" in refusal(*CPU, "checkpoint.save_at_end=false")


SINFO = "gpu 16\ncpu* 4\ngpu 4\n"  # a partition over two node states is listed twice


def query_with(sinfo=SINFO, accounts="proj_a\nproj_b\n"):
    return lambda cmd: {"sinfo": sinfo, "sacctmgr": accounts}[cmd[0]]


def test_partition_must_exist():
    [msg] = checks.partition_problems("h100", 2, query_with())
    assert "slurm.partition=h100 does not exist" in msg and "['cpu', 'gpu']" in msg


def test_default_partition_is_used_and_sized():
    assert checks.partition_problems(None, 4, query_with()) == []
    [msg] = checks.partition_problems(None, 5, query_with())
    assert "needs 5 nodes but partition cpu has 4" in msg
    assert checks.partition_problems("gpu", 20, query_with()) == []  # 16 + 4 nodes


def test_no_partition_and_no_default_is_refused():
    [msg] = checks.partition_problems(None, 1, query_with(sinfo="gpu 4\n"))
    assert "set slurm.partition to one of ['gpu']" in msg


def test_no_sinfo_is_refused():
    [msg] = checks.partition_problems("gpu", 1, lambda cmd: None)
    assert "login node" in msg and "--dry-run" in msg


NODES = "n1 cpu* 2 (null)\nn2 cpu* 2 (null)\ng1 gpu 96 gpu:h100:8(S:0-1)\ng2 gpu 96 gpu:h100:4(S:0),gpu:a100:4(S:1)\n" \
        "g3 gpu 96 gpu:h100:4(S:0-1)\n"


def node_refusals(partition, *overrides, hetjob=True, cpus_per_task=0):
    run, layout = layout_of(*overrides)
    return checks.node_problems(partition, layout, hetjob=hetjob, cpus_per_task=cpus_per_task,
                                query=lambda cmd: NODES)


def test_ranks_per_node_must_fit_the_cpus_of_the_nodes():
    assert node_refusals(None, *CPU, "launch.nproc_per_node=2") == []  # 2 ranks on 2-CPU nodes
    [msg] = node_refusals(None, *CPU, "launch.nproc_per_node=4")
    assert "the trainer needs 1 node(s) with 4 CPUs" in msg and "partition cpu has 0 such node(s)" in msg
    assert "lower launch.nproc_per_node" in msg and "2 CPUs and 0 GPUs" in msg
    [msg] = node_refusals(None, *CPU, "launch.nproc_per_node=2", cpus_per_task=2)  # 2 ranks x 2 CPUs
    assert "4 CPUs (2 task(s) x 2 CPU)" in msg and "slurm.cpus_per_task" in msg
    [msg] = node_refusals(None, *CPU, "launch.nproc_per_node=1", "slurm.servers_per_node=4", "fleet.num_servers=4",
                          hetjob=False)
    assert msg.startswith("the job needs 2 node(s) with 4 CPUs")


def test_gpus_per_node_must_be_what_the_nodes_have():
    # 8 GPUs: g1 (8) and g2 (4 + 4 of two kinds) fit; 2 trainer nodes + 1 rollout node of 8 would need 3
    assert node_refusals("gpu", *GPU, "fleet.num_servers=8") == []
    [msg] = node_refusals("gpu", *GPU, "launch.nnodes=2", hetjob=False)
    assert "needs 3 node(s)" in msg and "partition gpu has 2 such node(s)" in msg
    [msg] = node_refusals("cpu", *GPU, "fleet.num_servers=8")[:1]
    assert "set slurm.gpus_per_node to what the nodes have" in msg


def test_stop_time_notes_compare_the_measured_stop_with_slurm(tmp_path):
    def query(cmd):
        return "KillWait                = 30 sec\n"

    [note] = checks.stop_time_notes(str(tmp_path), 600, query)
    assert "not measured yet" in note and "KillWait 30s" in note
    (tmp_path / "checkpoints" / "step_00000004").mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("step_00000004")
    (tmp_path / "checkpoints" / "step_00000004" / "stop_seconds").write_text("20\n")
    assert not any("warning" in n for n in checks.stop_time_notes(str(tmp_path), 600, query))
    (tmp_path / "checkpoints" / "step_00000004" / "stop_seconds").write_text("45\n")
    notes = checks.stop_time_notes(str(tmp_path), 40, query)
    assert any("KillWait is 30s" in n for n in notes) and any("slurm.signal_s=40" in n for n in notes)


def test_account_must_be_one_of_the_users():
    problems, _ = checks.account_problems("proj_c", "alice", query_with())
    assert "slurm.account=proj_c is not one of alice's accounts ['proj_a', 'proj_b']" in problems[0]
    assert checks.account_problems("proj_b", "alice", query_with())[0] == []
    problems, note = checks.account_problems("proj_c", "alice", lambda cmd: None)  # accounting off: not checkable
    assert problems == [] and "not checked" in note


MOUNTS = "overlay / overlay rw 0 0\nserver:/home /home nfs4 rw 0 0\n/dev/sda1 /scratch ext4 rw 0 0\n"


@pytest.mark.parametrize("path,expected", [
    ("/tmp/runs/a", "under /tmp, which is local to each node"),
    ("/dev/shm/x", "under /dev/shm"),
    ("/scratch/me/run", "local ext4 filesystem (mounted at /scratch)"),
    ("/opt/run", "local overlay filesystem (mounted at /)"),
    ("/home/me/runs/a1", None),
])
def test_run_dir_must_be_shared(path, expected):
    msg = checks.path_problem("run_dir", path, [], MOUNTS)
    if expected is None:
        assert msg is None
    else:
        assert expected in msg and "slurm.shared_roots" in msg and checks.SHARED_ROOTS_ENV in msg


def test_shared_roots_accept_a_path(tmp_path):
    roots = checks.shared_roots([], {checks.SHARED_ROOTS_ENV: f"/nonexistent:{tmp_path}"})
    assert checks.path_problem("run_dir", str(tmp_path / "run"), roots, MOUNTS) is None
    assert checks.path_problem("run_dir", str(tmp_path / "run"), [], MOUNTS) is not None


def test_submit_refuses_a_local_run_dir_before_sbatch(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(checks.SHARED_ROOTS_ENV, raising=False)
    monkeypatch.setattr(submit_cli, "submit", lambda script: pytest.fail("sbatch must not be reached"))
    code = submit_cli.main(["--config-name", "tiny_cpu", *CPU, f"run_dir={tmp_path}/run", "--dry-run"])
    assert code == 2
    err = capsys.readouterr().err
    assert f"run_dir={tmp_path}/run is under /tmp" in err and "not submitted" in err
    assert not (tmp_path / "run" / "slurm").exists()


def sbatch_options(script: str) -> list[str]:
    """The #SBATCH lines sbatch reads: those before the first command."""
    out = []
    for line in script.splitlines()[1:]:
        if line.startswith("#SBATCH"):
            out.append(line.split(None, 1)[1])
        elif line.strip() and not line.startswith("#"):
            break
    return out


def test_dry_run_writes_a_hetjob_script(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(checks.SHARED_ROOTS_ENV, f"{tmp_path}:{Path(sys.executable).resolve().parent}")
    code = submit_cli.main(["--config-name", "tiny_cpu", *CPU, "trainer.steps=3", "slurm.partition=debug",
                            "slurm.time=00:20:00", f"run_dir={tmp_path}/run", "--dry-run"])
    assert code == 0
    out = capsys.readouterr().out
    script = Path(re.search(r"script: (\S+)", out).group(1))
    text = script.read_text()
    opts = sbatch_options(text)
    split = opts.index("hetjob")
    assert {"--partition=debug", "--time=00:20:00", "--nodes=1", "--ntasks-per-node=2"} <= set(opts[:split])
    assert {"--partition=debug", "--nodes=1", "--ntasks-per-node=1"} <= set(opts[split + 1:])
    assert f"--output={tmp_path}/run/slurm/apriel-%j.out" in opts and "--requeue" in opts
    assert any(o.startswith("--signal=B:USR1@") for o in opts)
    values = {k: shlex.split(v)[0] if v != "''" else "" for k, v in re.findall(r"^(APRIEL_[A-Z_]+)=(.*)$", text, re.M)}
    assert shlex.split(values["APRIEL_OVERRIDES"]) == ["slurm.gpus_per_node=0", "slurm.servers_per_node=1",
                                                        "trainer.steps=3", "slurm.partition=debug",
                                                        "slurm.time=00:20:00"]
    assert values["APRIEL_RUN_DIR"] == f"{tmp_path}/run"
    assert values["APRIEL_TRAIN_TASKS_PER_NODE"] == "2" and values["APRIEL_GPUS_PER_NODE"] == "0"


def test_plain_job_asks_for_all_nodes_at_once(tmp_path):
    run, layout = layout_of(*GPU, "launch.nnodes=2", "fleet.num_servers=16", "slurm.hetjob=false",
                            f"run_dir={tmp_path}")
    opts = sbatch_options(render(shipped("train.sbatch").read_text(), run, layout, "tiny_cpu", []))
    assert "hetjob" not in opts
    assert {"--nodes=4", "--ntasks-per-node=8", "--gpus-per-node=8", "--exclusive"} <= set(opts)


@pytest.mark.parametrize("name", ["train.sbatch", "convert.sbatch", "eval.sbatch"])
def test_every_knob_is_a_documented_variable_at_the_top(name):
    """Cluster differences are variables with a comment above them, all before the first command."""
    lines = shipped(name).read_text().splitlines()
    knobs = [i for i, line in enumerate(lines) if re.match(r': "\$\{APRIEL_[A-Z_]+:=', line)]
    assert knobs, name
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith(("#", ": ")))
    assert max(knobs) < first_command
    for i in knobs:
        assert lines[i - 1].startswith("#") or re.match(r': "\$\{APRIEL_', lines[i - 1]), lines[i]


ONE_NODE = ["launch.gpus_per_node=8", "slurm.gpus_per_node=8", "slurm.servers_per_node=0", "launch.nproc_per_node=4",
            "fleet.num_servers=2", "fleet.vllm_args=[-tp,2]"]  # 2 servers x 2 GPUs + 4 ranks = 8


def test_one_node_layout_is_one_plain_job_whatever_slurm_hetjob_says(tmp_path):
    run, layout = layout_of(*ONE_NODE, "slurm.hetjob=true", f"run_dir={tmp_path}")
    assert layout.one_node and layout.total_nodes == 1 and layout.num_servers == 2
    text = render(shipped("train.sbatch").read_text(), run, layout, "tiny_cpu", [])
    opts = sbatch_options(text)
    assert "hetjob" not in opts
    assert {"--nodes=1", "--ntasks-per-node=4", "--gpus-per-node=8", "--exclusive"} <= set(opts)
    assert re.search(r"^APRIEL_ONE_NODE=1$", text, re.M) and re.search(r"^APRIEL_SERVERS_PER_NODE=2$", text, re.M)
    _, two_nodes = layout_of(*CPU)
    assert not two_nodes.one_node and two_nodes.total_nodes == 2


@pytest.mark.parametrize("extra, expected", [
    (["launch.nnodes=2"], "set launch.nnodes=1, or launch.gpus_per_node=0"),
    (["slurm.gpus_per_node=4"], "set slurm.gpus_per_node=8 (or 0"),
    (["slurm.servers_per_node=1"], "set slurm.servers_per_node=0"),
    (["fleet.num_servers=3"], "cannot hold fleet.num_servers=3 x 2 GPU(s) per server"),
    (["launch.nproc_per_node=3", "fleet.num_servers=1", "parallel.tp=2"], "parallel.tp"),
])
def test_one_node_refusals_name_the_keys(extra, expected):
    assert expected in refusal(*ONE_NODE, *extra)


def test_one_node_without_gres_hands_out_the_gpus_by_count():
    """slurm.gpus_per_node=0 on one node: no --gpus-per-node (a cluster that does not schedule GPUs)."""
    run, layout = layout_of(*ONE_NODE, "slurm.gpus_per_node=0", "slurm.servers_per_node=2")
    assert layout.one_node and layout.gpus_per_node == 0
    assert not any(o.startswith("--gpus-per-node") for o in sbatch_options(
        render(shipped("train.sbatch").read_text(), run, layout, "tiny_cpu", [])))


def test_dry_run_of_a_one_node_job_prints_each_process_gpus(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(checks.SHARED_ROOTS_ENV, f"{tmp_path}:{Path(sys.executable).resolve().parent}")
    code = submit_cli.main(["--config-name", "tiny_cpu", *ONE_NODE, "launch.nproc_per_node=2",
                            f"run_dir={tmp_path}/run", "--dry-run"])
    assert code == 0
    out = capsys.readouterr().out
    assert "one-node plain job: 2 trainer rank(s) and 2 vLLM server(s) sharing its 8 GPUs" in out
    assert "servers on GPUs 0,1 | 2,3, trainer on 4,5, idle 6,7" in out

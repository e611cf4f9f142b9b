"""One machine's GPUs between the fleet and the trainer (launch.gpus_per_node): the split for several
layouts against hand-written expectations, the refusals, each component's CUDA_VISIBLE_DEVICES (also
after a restart) and the dry run's printout. Nothing here needs a GPU: the devices are only named."""

import sys
from pathlib import Path

import pytest

from megatron_apriel.config import compose_config, to_run_config
from megatron_apriel.launch.components import Component, components
from megatron_apriel.parallel.devices import DeviceSplit, split_devices
from tests.unit.launch.test_launch import apriel_train


@pytest.mark.parametrize("args, want", [
    ((8, 2, 1, 2, None), DeviceSplit(("0", "1"), "2,3", ("4", "5", "6", "7"))),
    ((8, 2, 2, 4, None), DeviceSplit(("0,1", "2,3"), "4,5,6,7")),
    ((8, 4, 1, 4, None), DeviceSplit(("0", "1", "2", "3"), "4,5,6,7")),
    ((8, 0, 1, 8, None), DeviceSplit((), "0,1,2,3,4,5,6,7")),  # servers elsewhere: the node is the trainer's
    ((4, 1, 1, 3, "4,5,6,7"), DeviceSplit(("4",), "5,6,7")),  # the launcher's own visible GPUs, in its order
    ((2, 1, 1, 1, "3,1,0"), DeviceSplit(("3",), "1")),
])
def test_the_split_for_several_layouts(args, want):
    assert split_devices(*args) == want


def test_a_cpu_machine_gets_no_devices():
    assert split_devices(0, 2, 1, 2) is None


@pytest.mark.parametrize("args, keys", [
    ((4, 2, 2, 1, None), ["launch.gpus_per_node=4", "fleet.num_servers=2", "launch.nproc_per_node=1"]),
    ((8, 1, 1, 8, None), ["launch.gpus_per_node=8", "launch.nproc_per_node=8"]),
    ((4, 1, 1, 1, "0,1"), ["launch.gpus_per_node=4", "CUDA_VISIBLE_DEVICES=0,1"]),
])
def test_a_split_that_does_not_fit_is_refused_naming_the_keys(args, keys):
    with pytest.raises(ValueError) as err:
        split_devices(*args)
    assert all(k in str(err.value) for k in keys), str(err.value)


def run_config(tmp_path, *overrides):
    return to_run_config(compose_config("tiny_cpu", [f"run_dir={tmp_path / 'run'}", *overrides]))


def test_each_component_gets_its_own_gpus(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    run = run_config(tmp_path, "launch.gpus_per_node=8", "fleet.num_servers=3", "launch.nproc_per_node=4",
                     "fleet.vllm_args=[--tensor-parallel-size,1]")
    got = {c.name: c.env.get("CUDA_VISIBLE_DEVICES") for c in components(run)}
    assert got == {"server_0": "0", "server_1": "1", "server_2": "2", "actor": "", "trainer": "3,4,5,6"}
    cpu = {c.name: c.env.get("CUDA_VISIBLE_DEVICES") for c in components(run_config(tmp_path))}
    assert set(cpu.values()) == {None}  # launch.gpus_per_node=0: the environment is the launcher's


def test_a_restarted_server_gets_the_same_gpus_back(tmp_path):
    c = Component("server_1", ["sh", "-c", "echo $CUDA_VISIBLE_DEVICES; exit 3"], tmp_path / "s.log",
                  {"CUDA_VISIBLE_DEVICES": "2,3"}, restarts_left=1)
    for _ in range(2):  # the launcher's restart: stop what is left, start the same component again
        c.start()
        assert c.proc.wait(30) == 3
        c.stop()
    printed = [line for line in (tmp_path / "s.log").read_text().splitlines() if line and not line.startswith("=")]
    assert printed == ["2,3", "2,3"]


def test_the_dry_run_prints_each_processs_gpus(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    proc = apriel_train("--config-name", "tiny_cpu", f"run_dir={tmp_path / 'run'}", "launch.dry_run=true",
                        "launch.gpus_per_node=8", "fleet.num_servers=2", "launch.nproc_per_node=4",
                        "fleet.vllm_args=[--tensor-parallel-size,2]", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line.startswith("  ")}
    assert "CUDA_VISIBLE_DEVICES=0,1 " in lines["server_0"] and "CUDA_VISIBLE_DEVICES=2,3 " in lines["server_1"]
    assert "CUDA_VISIBLE_DEVICES=4,5,6,7 " in lines["trainer"] and "CUDA_VISIBLE_DEVICES= " in lines["actor"]
    refused = apriel_train("--config-name", "tiny_cpu", f"run_dir={tmp_path / 'run2'}", "launch.dry_run=true",
                           "launch.gpus_per_node=4", "fleet.num_servers=2", "launch.nproc_per_node=4", cwd=tmp_path)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "launch.gpus_per_node=4 cannot hold fleet.num_servers=2" in refused.stderr


def test_the_planners_one_node_command_passes_the_dry_run(tmp_path, monkeypatch, capsys):
    """apriel-plan's one-node keys for Apriel-15B on 8 GPUs, on the recipe's preset, as it prints them:
    the dry run takes them and gives the four servers one GPU each and the trainer the other four."""
    import shlex

    from megatron_apriel.entrypoints.plan import main as plan
    from tests.unit.launch.test_launch import FIVE_DOMAINS, apriel_model, data_list

    assert plan(["--preset", "apriel_15b", "--nodes", "1", "--gpus-per-node", "8", "--gpu-memory-gb", "80"]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("one-node launch:")]
    keys = shlex.split(line.split("...", 1)[1])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    model = apriel_model(tmp_path)
    proc = apriel_train("--config-name", "apriel_15b", f"model.hf_path={model}", data_list(FIVE_DOMAINS),
                        f"run_dir={tmp_path / 'run'}", "launch.dry_run=true", *keys, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("  ")]
    assert [line.split()[1] for line in lines if line.split()[0].startswith("server_")] == \
        [f"CUDA_VISIBLE_DEVICES={i}" for i in range(4)]
    assert "CUDA_VISIBLE_DEVICES=4,5,6,7 " in next(line for line in lines if line.split()[0] == "trainer")
    assert "the launch would refuse" not in proc.stdout

    # the same keys make a one-node SLURM job with the same split
    from megatron_apriel.entrypoints import submit
    from megatron_apriel.slurm import checks

    monkeypatch.setenv(checks.SHARED_ROOTS_ENV, f"{tmp_path}:{Path(sys.executable).resolve().parent}")
    assert submit.main(["--config-name", "apriel_15b", f"model.hf_path={model}", data_list(FIVE_DOMAINS),
                        f"run_dir={tmp_path / 'run'}", *keys, "--dry-run"]) == 0
    assert ("one-node plain job: 4 trainer rank(s) and 4 vLLM server(s) sharing its 8 GPUs (servers on GPUs "
            "0 | 1 | 2 | 3, trainer on 4,5,6,7)") in capsys.readouterr().out


def test_an_empty_cuda_visible_devices_hides_every_gpu():
    """"" is not "unset": no GPU is visible, so a split that needs one is refused."""
    with pytest.raises(ValueError, match='CUDA_VISIBLE_DEVICES="" shows 0'):
        split_devices(2, 1, 1, 1, "")
    with pytest.raises(ValueError, match="--gpu-bind=none"):  # the advice that helps under SLURM
        split_devices(4, 1, 1, 1, "0,1")


def test_a_data_parallel_server_takes_tp_x_pp_x_dp_gpus():
    from megatron_apriel.fleet.config import ServerArgs

    args = ServerArgs(("--tensor-parallel-size", "2", "--data-parallel-size=2"))
    assert args.gpus == 4
    assert split_devices(8, 1, args.gpus, 4) == DeviceSplit(("0,1,2,3",), "4,5,6,7")


def fake_gpus(tmp_path, n: int):
    for i in range(n):
        (tmp_path / f"nvidia{i}").touch()
    (tmp_path / "nvidiactl").touch()  # not a GPU
    return tmp_path


def test_the_gpus_present_are_the_device_files_cuda_visible_devices_leaves(tmp_path):
    from megatron_apriel.parallel.devices import gpus_present

    dev = fake_gpus(tmp_path, 8)
    assert gpus_present({}, dev) == 8
    assert gpus_present({"CUDA_VISIBLE_DEVICES": "2,3"}, dev) == 2
    assert gpus_present({"CUDA_VISIBLE_DEVICES": ""}, dev) == 0
    (tmp_path / "cpu").mkdir()
    assert gpus_present({"CUDA_VISIBLE_DEVICES": "0,1"}, tmp_path / "cpu") == 0  # a CPU machine, whatever it says


def test_a_gpu_machine_with_local_servers_and_no_split_is_refused():
    from megatron_apriel.parallel.devices import check_gpus_present

    with pytest.raises(ValueError, match="set launch.gpus_per_node=8 to split them"):
        check_gpus_present(0, 1, 8)  # the large presets' default: every process would see every GPU
    with pytest.raises(ValueError, match="launch.gpus_per_node=16 but this machine shows 8"):
        check_gpus_present(16, 4, 8)
    check_gpus_present(8, 4, 8)
    check_gpus_present(0, 0, 8)  # servers elsewhere (fleet.servers): the node is the trainer's
    check_gpus_present(0, 2, 0)  # a CPU machine


def test_the_dry_run_on_a_gpu_machine_refuses_the_presets_default_in_one_line(tmp_path, monkeypatch):
    import megatron_apriel.launch.components as components

    monkeypatch.setattr(components, "gpus_present", lambda env: 8)
    with pytest.raises(ValueError, match="launch.gpus_per_node=0 would give every process every GPU"):
        components.components(run_config(tmp_path, "launch.nproc_per_node=4"))


def test_each_local_server_gets_its_own_core_on_a_cpu_machine(tmp_path, monkeypatch):
    """vLLM's default binds every CPU server's worker to one core; the launch spreads them: server i
    on core i (from APRIEL_FIRST_CORE, wrapping), unless the user binds them."""
    from megatron_apriel.launch.components import components, server_core

    assert [server_core(i, {}, [0, 1]) for i in range(3)] == [0, 1, 0]
    assert [server_core(i, {"APRIEL_FIRST_CORE": "1"}, [0, 1]) for i in range(2)] == [1, 0]
    assert server_core(0, {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, [0, 1]) is None
    assert server_core(0, {}, [0]) is None
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("APRIEL_FIRST_CORE", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    parts = components(run_config(tmp_path, "fleet.num_servers=2"))
    assert [c.env.get("VLLM_CPU_OMP_THREADS_BIND") for c in parts if c.name.startswith("server_")] == ["0", "1"]

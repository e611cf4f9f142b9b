"""The SLURM job's per-node steps: server placement (GPU shares, addresses) and the allocation check."""

import pytest

from megatron_apriel.config import compose_run
from megatron_apriel.entrypoints.job_step import gpu_slice
from megatron_apriel.slurm.layout import check_allocation, job_node_address, node_address, one_node_split


def test_each_server_gets_its_own_share_of_the_gpus():
    shares = [gpu_slice(i, 4, 8, None) for i in range(4)]
    assert shares == ["0,1", "2,3", "4,5", "6,7"]
    assert gpu_slice(1, 2, 4, "4,5,6,7") == "6,7"  # what SLURM made visible, not 0..N-1
    with pytest.raises(ValueError, match="8 servers per node but only 4 GPUs"):
        gpu_slice(0, 8, 4, None)


def test_node_address_comes_from_the_job_table():
    assert node_address("n1=10.0.0.1 n2=10.0.0.2", "n2") == "10.0.0.2"
    with pytest.raises(ValueError, match="node n3 is not in APRIEL_NODE_ADDRS"):
        node_address("n1=10.0.0.1", "n3")


def test_a_trainer_rank_in_the_job_advertises_its_nodes_address_not_its_host_name():
    env = {"APRIEL_NODE_ADDRS": "n1=10.0.0.1 n2=10.0.0.2", "SLURMD_NODENAME": "n1"}
    assert job_node_address(env) == "10.0.0.1"
    assert job_node_address({"SLURMD_NODENAME": "n1"}) is None  # a job step not of slurm/train.sbatch
    assert job_node_address({}) is None


def test_allocation_that_does_not_fit_the_config_is_refused():
    run, _ = compose_run("tiny_cpu", [])
    assert check_allocation(run, 1, 2, 1, 1).num_servers == 1
    with pytest.raises(ValueError, match="launch.nnodes=1 x launch.nproc_per_node=2") as err:
        check_allocation(run, 1, 4, 1, 1)
    assert "APRIEL_*" in str(err.value)
    with pytest.raises(ValueError, match="fleet.num_servers=1"):
        check_allocation(run, 1, 2, 2, 1)


def test_one_node_allocation_must_be_what_the_config_says():
    run, _ = compose_run("tiny_cpu", ["launch.gpus_per_node=4"])
    assert check_allocation(run, 1, 2, 1, 1, one_node=True).one_node
    with pytest.raises(ValueError, match=r"\(APRIEL_ONE_NODE=0\) but the config has launch.gpus_per_node=4"):
        check_allocation(run, 1, 2, 1, 1)
    two_nodes, _ = compose_run("tiny_cpu", [])
    with pytest.raises(ValueError, match=r"\(APRIEL_ONE_NODE=1\) but the config has launch.gpus_per_node=0"):
        check_allocation(two_nodes, 1, 2, 1, 1, one_node=True)


def test_one_node_split_is_over_what_the_step_sees():
    """Every step of a one-node job sees the node's GPUs; each process takes its share of them."""
    run, _ = compose_run("tiny_cpu", ["launch.gpus_per_node=4", "fleet.num_servers=2"])
    split = one_node_split(run, "4,5,6,7")
    assert (split.servers, split.trainer, split.idle) == (("4", "5"), "6,7", ())
    assert one_node_split(run).servers == ("0", "1")

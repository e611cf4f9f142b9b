"""Two runs on one node never collide on the weight-sync port: with the default config each stage's
sender binds a free port itself (the bind is the choice), so two runs' stage groups exist at once
and each receiver gets its own run's weights. Before, every run's stage 0 bound 29700 and the
second run's sender failed to bind (or, started a moment later, joined the first run's store)."""

import threading

import pytest
import torch

from megatron_apriel.weight_sync.config import WeightSyncConfig
from megatron_apriel.weight_sync.transport import host_stage_store, join_stage_group

CPU = torch.device("cpu")


def test_two_runs_push_at_the_same_time_each_on_a_port_of_its_own():
    cfg = WeightSyncConfig()
    # both runs' senders host their stage store before either push starts: their pushes overlap
    hosted = [host_stage_store("127.0.0.1", cfg.stage_port(0), 2, 30) for _ in range(2)]
    ports = [endpoint.port for _, endpoint in hosted]
    assert ports[0] != ports[1] and all(ports)
    received: dict[int, float] = {}

    def sender(run: int) -> None:
        store, endpoint = hosted[run]
        group = join_stage_group(endpoint, 0, 2, "gloo", 30, CPU, store=store)
        group.broadcast(torch.full((4,), float(run + 1)))
        group.close()

    def receiver(run: int) -> None:
        group = join_stage_group(hosted[run][1], 1, 2, "gloo", 30, CPU)
        got = torch.zeros(4)
        group.broadcast(got)
        received[run] = got.unique().item()
        group.close()

    threads = [threading.Thread(target=f, args=(run,)) for run in range(2) for f in (sender, receiver)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert received == {0: 1.0, 1: 2.0}


def test_a_fixed_base_port_still_gives_stage_s_base_plus_s():
    cfg = WeightSyncConfig(base_port=29700)
    assert [cfg.stage_port(s) for s in range(3)] == [29700, 29701, 29702]
    assert WeightSyncConfig().stage_port(5) == 0
    with pytest.raises(ValueError, match="weight_sync.base_port=70000 is not a port"):
        WeightSyncConfig(base_port=70000)

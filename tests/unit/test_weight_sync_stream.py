"""One stage's update over a real 2-process gloo group: buckets (with strided sources and mixed
dtypes) arrive intact, and a byte flipped after sealing marks that bucket bad (no vLLM)."""

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.multiprocessing as mp

from megatron_apriel.parallel.rendezvous import free_port
from megatron_apriel.weight_sync import buckets as B
from megatron_apriel.weight_sync.protocol import Endpoint, StagePlan
from megatron_apriel.weight_sync.stream import DoubleBuffer, receive_stage, send_stage
from megatron_apriel.weight_sync.transport import join_stage_group


def _tensors():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(300, 512, generator=g)
    return [("small", torch.randn(7, 3, generator=g)), ("big", big), ("strided_big", big.t()),
            ("half", torch.randn(33, generator=g).to(torch.bfloat16)), ("big2", torch.randn(1 << 15, generator=g))]


def _worker(rank: int, port: int, out) -> None:
    group = join_stage_group(Endpoint(host="127.0.0.1", port=port), rank, 2, "gloo", 60, torch.device("cpu"))
    tensors = _tensors()
    layouts = B.plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in tensors], 1 << 20)
    results = []
    for corrupt in (None, 1):
        plan = StagePlan(version=1, stage=0, num_stages=1, checksum="sum64", buckets=layouts)
        if rank == 0:
            def flip(stage, index, data, corrupt=corrupt):
                if index == corrupt:
                    data[5] ^= 0x01
            send_stage(group, plan, iter([(n, t.clone()) for n, t in tensors]), DoubleBuffer(torch.device("cpu")), flip)
        else:
            inbox = receive_stage(group, ThreadPoolExecutor(1))
            same = [torch.equal(a, b) for (_, a), (_, b) in zip(tensors, inbox.tensors(), strict=True)]
            results.append((len(inbox.bad_buckets), all(same)))
    if rank == 1:
        out.put(([[s.name for s in b.tensors] for b in layouts], results))
    group.close()


def test_buckets_roundtrip_and_corruption_is_caught():
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    names, results = out.get()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert names == [["small", "big"], ["strided_big", "half", "big2"]]
    assert results == [(0, True), (1, False)]

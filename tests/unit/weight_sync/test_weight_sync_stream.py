"""One stage's update over a real 2-process gloo group: direct and packed buckets (with strided
sources and mixed dtypes) arrive intact, and a byte flipped on the wire after the checksum was
taken, in any bucket of either kind and at either end, marks exactly that bucket bad (no vLLM)."""

import os
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.multiprocessing as mp

from megatron_apriel.parallel.rendezvous import free_port
from megatron_apriel.records.weights import Endpoint, StagePlan
from megatron_apriel.weight_sync import buckets as B
from megatron_apriel.weight_sync.transport import join_stage_group, recv_plan
from megatron_apriel.weight_sync.wire import DoubleBuffer, receive_stage, send_stage


def _tensors():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(300, 512, generator=g)
    return [("small", torch.randn(7, 3, generator=g)), ("big", big), ("strided_big", big.t()),
            ("half", torch.randn(33, generator=g).to(torch.bfloat16)), ("big2", torch.randn(1 << 15, generator=g))]


DIRECT = 200_000  # bytes: "big" and "strided_big" (614 400 each) go direct, the rest is packed
CORRUPT = [None, (0, 0), (1, -1), (2, 100_000), (2, -1)]  # (bucket, byte position) flipped on the wire


def _worker(rank: int, port: int, out) -> None:
    group = join_stage_group(Endpoint(host="127.0.0.1", port=port), rank, 2, "gloo", 60, torch.device("cpu"))
    tensors = _tensors()
    layouts = B.plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in tensors], 1 << 20, DIRECT)
    results = []
    for corrupt in CORRUPT:
        plan = StagePlan(version=1, stage=0, num_stages=1, checksum="sum64", buckets=layouts)
        if rank == 0:
            def flip(stage, layout, data, corrupt=corrupt):
                if corrupt is not None and layout.index == corrupt[0]:
                    bad = data.clone()  # a direct bucket's bytes are the sender's own tensor: never touch them
                    bad[corrupt[1]] ^= 0x01
                    return bad
                return None
            source = [(n, t.clone()) for n, t in tensors]
            send_stage(group, plan, iter(source), DoubleBuffer(torch.device("cpu")), flip)
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(tensors, source))
        else:
            inbox = receive_stage(group, ThreadPoolExecutor(1))
            got = dict(inbox.tensors())
            same = {n: torch.equal(t, got[n]) for n, t in tensors}
            results.append(([b.split()[4] for b in inbox.bad_buckets], sorted(n for n, ok in same.items() if not ok)))
    if rank == 1:
        out.put(([([s.name for s in b.tensors], b.direct) for b in layouts], results))
    group.close()


def _spawn(target, world: int):
    """``world`` processes running ``target(rank, port, queue)``, joined in one stage group at ``port``."""
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=target, args=(r, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    return procs, out


def test_buckets_roundtrip_and_corruption_is_caught():
    procs, out = _spawn(_worker, 2)
    layouts, results = out.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert layouts == [(["big"], True), (["strided_big"], True), (["small", "half", "big2"], False)]
    # bytes 100 000 and -1 of the packed bucket fall in big2 (small@0, half@128, big2@256)
    assert results == [([], []), (["0"], ["big"]), (["1"], ["strided_big"]), (["2"], ["big2"]), (["2"], ["big2"])]


def _dying_worker(rank: int, port: int, out) -> None:
    """Rank 0 sends, rank 1 receives, rank 2 dies (hard) after the plan: a server killed mid-update."""
    group = join_stage_group(Endpoint(host="127.0.0.1", port=port), rank, 3, "gloo", 60, torch.device("cpu"))
    tensors = _tensors()
    layouts = B.plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in tensors], 1 << 12)  # many buckets
    plan = StagePlan(version=1, stage=0, num_stages=1, checksum="sum64", buckets=layouts)
    if rank == 2:
        recv_plan(group)
        os._exit(0)
    if rank == 0:
        drawn = []
        source = ((drawn.append(n), (n, t))[1] for n, t in tensors)
        failure = send_stage(group, plan, source, DoubleBuffer(torch.device("cpu")))
        group.close()  # what the sender does before joining the fleet again
        out.put(("sender", failure, drawn))
        return
    try:
        receive_stage(group, ThreadPoolExecutor(1))
        out.put(("receiver", None))
    except RuntimeError as err:
        out.put(("receiver", type(err).__name__))


def test_a_receiver_dying_mid_update_fails_the_send_without_desynchronising_the_sender():
    procs, out = _spawn(_dying_worker, 3)
    got = dict((item[0], item[1:]) for item in (out.get(timeout=120), out.get(timeout=120)))
    for p in procs:
        p.join(timeout=90)
    failure, drawn = got["sender"]
    assert failure is not None  # reported, not raised, not hung
    assert drawn == [n for n, _ in _tensors()]  # every tensor drawn: TP peers gathering them stay in step
    # a death before the last
    assert len(B.plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in _tensors()], 1 << 12)) == 5
    assert procs[0].exitcode == 0 and procs[2].exitcode == 0

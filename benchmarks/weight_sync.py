"""Weight-sync bandwidth and generation pause, on this machine (prints numbers; asserts nothing).

    PYTHONPATH=. python benchmarks/weight_sync.py                 # bandwidth only (gloo, 2 processes)
    PYTHONPATH=. python benchmarks/weight_sync.py --vllm          # + pause per update on a real vLLM server

Bandwidth part: a sender and a receiver process joined by our stage group (gloo on CPU). For each
model, the same bytes three ways: ours (plan + checksummed buckets, double-buffered async
broadcast, receiver-side verification and host staging), a raw single flat-buffer broadcast
(the physical limit of the link), and one broadcast per tensor (PipelineRL's way). Median of
``--repeats`` (all variants interleaved in each round). ``--breakdown`` adds ours without
checksums and without packing, to show where the time beyond the raw broadcast goes.

Pause part (``--vllm``): a one-rank Megatron trainer pushes the tiny model to a real
``apriel-serve`` while 16 requests decode; reports the wall time between /pause and /resume.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp

from megatron_apriel.parallel.rendezvous import free_port
from megatron_apriel.weight_sync import buckets as B
from megatron_apriel.weight_sync.protocol import Endpoint, StagePlan
from megatron_apriel.weight_sync.stream import DoubleBuffer, receive_stage, send_stage
from megatron_apriel.weight_sync.transport import join_stage_group


def llama_like(hidden: int, ffn: int, layers: int, vocab: int, kv_ratio: int = 2) -> list[tuple[str, tuple]]:
    kv = hidden // kv_ratio
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (hidden,)), (p + "self_attn.q_proj.weight", (hidden, hidden)),
                   (p + "self_attn.k_proj.weight", (kv, hidden)), (p + "self_attn.v_proj.weight", (kv, hidden)),
                   (p + "self_attn.o_proj.weight", (hidden, hidden)), (p + "post_attention_layernorm.weight", (hidden,)),
                   (p + "mlp.gate_proj.weight", (ffn, hidden)), (p + "mlp.up_proj.weight", (ffn, hidden)),
                   (p + "mlp.down_proj.weight", (hidden, ffn))]
    return shapes + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


MODELS = {
    "tiny (testing.tiny_model)": llama_like(128, 256, 2, 1024),
    "many small tensors (48 layers)": llama_like(256, 768, 48, 4096),
    "mid (8 layers, hidden 1024)": llama_like(1024, 2816, 8, 16384),
}


def _variants(group, rank: int, shapes, tensors, layouts, algo: str, checker, staging: dict):
    """Each variant moves the same bytes from rank 0 to rank 1; all buffers are allocated once and
    reused (as the GPU caching allocator would), so no variant pays page faults the others skip."""
    total = sum(l.nbytes for l in layouts)
    flat = torch.zeros(total, dtype=torch.uint8)
    buffers = DoubleBuffer(torch.device("cpu"))
    plain = [B.new_wire_buffer(l).zero_() for l in layouts]
    recv = [torch.zeros(s) for _, s in shapes] if rank == 1 else [t for _, t in tensors]
    plan = StagePlan(version=1, stage=0, num_stages=1, checksum=algo, buckets=layouts)

    def ours():
        if rank == 0:
            send_stage(group, plan, iter(tensors), buffers)
        elif receive_stage(group, checker, staging).bad_buckets:
            raise RuntimeError("a bucket failed its checksum in the benchmark")

    def raw():
        group.broadcast(flat)

    def per_tensor():  # PipelineRL: one synchronous broadcast per tensor, no packing, no checksum
        for buf in recv:
            group.broadcast(buf)

    def prepacked_buckets():  # ours minus packing and checksums: what bucket boundaries cost
        inflight = None
        for wire in plain:
            if inflight is not None:
                inflight.wait()
            inflight = group.broadcast(wire, async_op=True)
        inflight.wait()

    def pack_no_checksum():  # ours minus both checksum passes (and the plan message)
        inflight, it = None, iter(tensors)
        for layout in layouts:
            wire = buffers.wire(layout, layout.index % 2)
            if rank == 0:
                B.pack(layout, (next(it) for _ in layout.tensors), wire)
            if inflight is not None:
                inflight.wait()
            inflight = group.broadcast(wire, async_op=True)
        inflight.wait()

    return {"ours": ours, "raw": raw, "per_tensor": per_tensor, "prepacked buckets, no checksum": prepacked_buckets,
            "pack + buckets, no checksum": pack_no_checksum}


def _worker(rank: int, port: int, shapes, bucket_bytes: int, repeats: int, algo: str, breakdown: bool, out) -> None:
    from concurrent.futures import ThreadPoolExecutor

    torch.set_num_threads(1)
    group = join_stage_group(Endpoint(host="127.0.0.1", port=port), rank, 2, "gloo", 300, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    tensors = [(n, torch.randn(s, generator=g)) for n, s in shapes] if rank == 0 else []
    layouts = B.plan_buckets([(n, torch.float32, s) for n, s in shapes], bucket_bytes)
    variants = _variants(group, rank, shapes, tensors, layouts, algo, ThreadPoolExecutor(1), {})
    if not breakdown:
        variants = {k: variants[k] for k in ("ours", "raw", "per_tensor")}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats + 1):  # the first round warms every buffer up and is not counted
        for name, run in variants.items():  # interleaved, so load from other processes hits all alike
            group.broadcast(torch.zeros(1))
            t0 = time.perf_counter()
            run()
            group.broadcast(torch.zeros(1))
            times[name].append(time.perf_counter() - t0)
    if rank == 1:
        out.put((sum(l.nbytes for l in layouts), {k: statistics.median(v[1:]) for k, v in times.items()}))
    group.close()


def _run_model(shapes, bucket_bytes: int, repeats: int, algo: str, breakdown: bool):
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, shapes, bucket_bytes, repeats, algo, breakdown, out))
             for r in range(2)]
    for p in procs:
        p.start()
    total, t = out.get()
    for p in procs:
        p.join()
    return total, t


def bandwidth(bucket_bytes: int, repeats: int, algo: str, breakdown: bool) -> None:
    print(f"gloo over loopback, bucket {bucket_bytes / 2**20:.0f} MiB, checksum {algo}, median of {repeats}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'model':34s} {'tensors':>7s} {'MB':>8s} {'ours s':>8s} {'raw s':>8s} {'per-tensor s':>12s} "
          f"{'ours/raw bw':>11s} {'x vs per-tensor':>15s}")
    for name, shapes in MODELS.items():
        total, t = _run_model(shapes, bucket_bytes, repeats, algo, breakdown)
        print(f"{name:34s} {len(shapes):7d} {total / 1e6:8.1f} {t['ours']:8.4f} {t['raw']:8.4f} {t['per_tensor']:12.4f} "
              f"{t['raw'] / t['ours']:11.2f} {t['per_tensor'] / t['ours']:15.2f}")
        for k in [k for k in t if k not in ("ours", "raw", "per_tensor")]:
            print(f"    {k:44s} {t[k]:8.4f} s   {t['raw'] / t[k]:5.2f} of raw bw")


def _pause_trainer(url: str, model_dir: str, updates: int, out) -> None:
    import asyncio
    import threading

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    from megatron_apriel.model import ModelArch, ModelConfig, build_model
    from megatron_apriel.parallel import ParallelConfig, destroy_parallel, init_parallel
    from megatron_apriel.rollout.client import FleetClient, SamplingConfig
    from megatron_apriel.weight_sync.sender import WeightSender, WeightSyncConfig
    from megatron_apriel.weight_sync.source import table_to_hf

    ctx = init_parallel(ParallelConfig())
    arch = ModelArch.from_hf_dir(model_dir)
    model = build_model(ModelConfig(hf_path=model_dir), ctx)
    sender = WeightSender(WeightSyncConfig(advertise_host="127.0.0.1", base_port=free_port()), [url],
                          model, ctx, arch.vocab_size, table_to_hf(arch))
    sender.ensure_connected()
    reports, completions = [], []

    async def decode():
        client = FleetClient([url])
        outs = await asyncio.gather(*(client.generate([5 + i, 9], SamplingConfig(max_tokens=400, ignore_eos=True))
                                      for i in range(16)))
        completions.extend(c for o in outs for c in o)
        await client.aclose()

    for v in range(1, updates + 1):
        thread = threading.Thread(target=lambda: asyncio.run(decode()))
        thread.start()
        time.sleep(0.4)
        reports.append(sender.push(v))
        thread.join()
    status = sender.control.status(url)
    out.put(([r.model_dump() for r in reports], status.model_dump() if status else None,
             sum(c.finish_reason == "abort" for c in completions), len(completions)))
    sender.close()
    destroy_parallel()


def pause(updates: int) -> None:
    from megatron_apriel.rollout.fleet import start_server
    from megatron_apriel.testing.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(f"{tmp}/tiny"))
        server = start_server(model_dir, free_port(), f"{tmp}/server.log", extra_args=["--max-model-len", "512"])
        try:
            server.wait_healthy(240)
            ctx = mp.get_context("spawn")
            out = ctx.SimpleQueue()
            proc = ctx.Process(target=_pause_trainer, args=(server.url, model_dir, updates, out))
            proc.start()
            reports, status, aborted, n = out.get()
            proc.join()
        finally:
            server.stop()
    pauses = [r["pause_s"] for r in reports]
    totals = [r["total_s"] for r in reports]
    print(f"\nreal vLLM (tiny model), {updates} updates with 16 requests decoding: pause (/pause..resume) "
          f"median {statistics.median(pauses) * 1e3:.0f} ms, max {max(pauses) * 1e3:.0f} ms; whole update median "
          f"{statistics.median(totals) * 1e3:.0f} ms; last update on the server: receive {status['receive_s'] * 1e3:.0f} ms "
          f"(decoding continues), apply {status['apply_s'] * 1e3:.0f} ms; aborted requests: {aborted}/{n}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--checksum", choices=["sum64", "crc32"], default="sum64")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time ours without checksums, and without packing, to separate their costs")
    ap.add_argument("--vllm", action="store_true", help="also measure the pause on a real vLLM server")
    ap.add_argument("--updates", type=int, default=5)
    args = ap.parse_args()
    bandwidth(args.bucket_mb << 20, args.repeats, args.checksum, args.breakdown)
    if args.vllm:
        pause(args.updates)


if __name__ == "__main__":
    main()

"""Tokens/s of one GSPO optimizer step (TP=1, TP=2, PP=2, DP=2) vs a plain forward/backward.

    python benchmarks/trainer_step.py [--hidden 256 --layers 4 --seqs 32 --seq-len 256 --steps 5]
    python benchmarks/trainer_step.py --moe     # a mixture of experts: EP 2 vs EP 1, and the actor's
                                                # cost of routed experts

With ``--moe`` the model is a Qwen3-MoE of the same hidden size (8 experts of width 2 x hidden,
top-2: the dense model's active width), the samples carry routed experts and the step replays
them (rollout routing replay); the step runs on 2 gloo ranks with the experts on every rank (EP 1,
DP 2) and split over them (EP 2, DP 2), and the ratio EP 2 / EP 1 is printed. Then the actor's
wall time per rollout against a zero-latency fake fleet (``benchmarks/loop.py``), with and without
routed experts of Qwen3-30B-A3B's shape (48 layers x top-8 of 128) in every answer and record.

Baseline: the same Megatron GPTModel in one process, called directly (no DDP, no schedule, no
optimizer), loss = sum of token log-probs, forward + backward. Ours: ``train_step`` (Megatron
schedule, our vocab-parallel log-probs, GSPO loss, DDP grad reduction, distributed Adam, clip) on
packed rows, in each layout over 2 gloo ranks on this machine (1 rank for TP=1/DP=1). The ratio is
ours / baseline tokens per second of the whole machine; every number comes from this one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seqs", type=int, default=32, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (prompt 32 + completion)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up step)")
    p.add_argument("--moe", action="store_true", help="a mixture of experts: EP 2 vs EP 1, and the actor's overhead")
    p.add_argument("--ep", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--worker", choices=["plain", "ours"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--pp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--result-dir", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


EXPERTS, TOP_K = 8, 2


def _arch(a):
    from megatron_apriel.model import ModelArch

    if a.moe:
        return ModelArch(family="qwen3_moe", vocab_size=a.vocab, hidden_size=a.hidden, ffn_hidden_size=4 * a.hidden,
                         num_layers=a.layers, num_heads=8, num_kv_heads=4, head_dim=a.hidden // 8, qk_norm=True,
                         num_experts=EXPERTS, moe_top_k=TOP_K, moe_ffn_hidden_size=2 * a.hidden)
    return ModelArch(family="llama", vocab_size=a.vocab, hidden_size=a.hidden, ffn_hidden_size=4 * a.hidden,
                     num_layers=a.layers, num_heads=8, num_kv_heads=4, head_dim=a.hidden // 8)


def _samples(a):
    import numpy as np
    import torch

    from megatron_apriel.trainer.batch import TrainSample

    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    out = []
    for i in range(a.seqs):
        toks = torch.randint(0, a.vocab, (a.seq_len,), generator=g).tolist()
        routing = None
        if a.moe:  # as vLLM returns them: distinct experts per token and layer, the last token unrouted
            routing = np.argsort(rng.random((a.seq_len, a.layers, EXPERTS)), axis=-1)[..., :TOP_K].astype(np.int16)
            routing[-1] = -1
        out.append(TrainSample(toks, 32, [-8.3] * (a.seq_len - 32), advantage=float(i % 3 - 1), routing=routing))
    return out


def _timed(fn, steps):
    fn()  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker_plain(a):
    import torch

    from megatron_apriel.model import ModelConfig, build_model
    from megatron_apriel.parallel import ParallelConfig, init_parallel
    from megatron_apriel.trainer.batch import packed_microbatches

    ctx = init_parallel(ParallelConfig())
    model = build_model(ModelConfig(arch=_arch(a)), ctx)
    mbs = packed_microbatches(_samples(a), list(range(a.seqs)), a.seq_len)

    def step():
        model.zero_grad(set_to_none=True)
        for mb in mbs:
            logits = model(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params())
            logp = torch.log_softmax(logits.float(), -1).gather(-1, mb.labels.unsqueeze(-1)).squeeze(-1)
            (logp * mb.loss_mask).sum().backward()

    return _timed(step, a.steps)


def worker_ours(a):
    from megatron_apriel.model import ModelConfig, build_model
    from megatron_apriel.model.config import OptimConfig
    from megatron_apriel.model.routing import StageRouting
    from megatron_apriel.model.wrap import build_optimizer, wrap_model
    from megatron_apriel.parallel import ParallelConfig, init_parallel
    from megatron_apriel.trainer.batch import packed_microbatches, split_for_data_parallel
    from megatron_apriel.trainer.config import LossConfig
    from megatron_apriel.trainer.step import train_step

    ctx = init_parallel(ParallelConfig(tp=a.tp, pp=a.pp, ep=a.ep))
    arch = _arch(a)
    chunks = wrap_model(build_model(ModelConfig(arch=arch), ctx), ctx)
    routing = (StageRouting(chunks[0].module, moe_layers=arch.moe_layers, num_experts=arch.num_experts, replay=True)
               if arch.is_moe else None)
    optimizer, scheduler = build_optimizer(chunks, OptimConfig(lr=1e-5, warmup_steps=0), ctx, total_steps=100)
    mine, ids = split_for_data_parallel(_samples(a), ctx.dims.dp, ctx.dp_rank)
    mbs = packed_microbatches(mine, ids, a.seq_len)
    return _timed(lambda: train_step(chunks, mbs, optimizer=optimizer, scheduler=scheduler, ctx=ctx, cfg=LossConfig(),
                                      vocab_size=a.vocab, routing=routing), a.steps)


def _run_worker(a, kind, nproc, tp=1, pp=1, port=29561, ep=1):
    result_dir = tempfile.mkdtemp(prefix="trainer_step_")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port),
           __file__, "--worker", kind, "--tp", str(tp), "--pp", str(pp), "--ep", str(ep), "--hidden", str(a.hidden),
           "--layers", str(a.layers), "--vocab", str(a.vocab), "--seqs", str(a.seqs), "--seq-len", str(a.seq_len),
           "--steps", str(a.steps), "--result-dir", result_dir] + (["--moe"] if a.moe else [])
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    results = sorted(Path(result_dir).glob("rank_*.json"))
    if proc.returncode or len(results) != nproc:
        raise RuntimeError(f"{kind} tp={tp} pp={pp} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return max(json.loads(r.read_text())["seconds"] for r in results)  # the slowest rank bounds the step


def main(argv=None):
    a = _args(argv)
    if a.worker:
        seconds = worker_plain(a) if a.worker == "plain" else worker_ours(a)
        Path(a.result_dir, f"rank_{os.environ.get('RANK', '0')}.json").write_text(json.dumps({"seconds": seconds}))
        return
    if a.moe:
        return moe_main(a)
    tokens = a.seqs * a.seq_len
    base = _run_worker(a, "plain", 1)
    print(f"model: hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}; step = {a.seqs} x {a.seq_len} tokens")
    print(f"{'layout':<22}{'s/step':>9}{'tokens/s':>11}{'vs plain':>10}")
    print(f"{'plain fwd+bwd (1 proc)':<22}{base:>9.3f}{tokens / base:>11.0f}{1.0:>10.2f}")
    for name, nproc, tp, pp in [("ours TP1 (1 proc)", 1, 1, 1), ("ours DP2", 2, 1, 1), ("ours TP2", 2, 2, 1),
                                ("ours PP2", 2, 1, 2)]:
        s = _run_worker(a, "ours", nproc, tp, pp)
        print(f"{name:<22}{s:>9.3f}{tokens / s:>11.0f}{base / s:>10.2f}")


def moe_main(a) -> None:
    tokens = a.seqs * a.seq_len
    print(f"model: Qwen3-MoE, hidden {a.hidden}, {a.layers} layers, {EXPERTS} experts of {2 * a.hidden} top-{TOP_K}, "
          f"vocab {a.vocab}; step = {a.seqs} x {a.seq_len} tokens, routed experts replayed")
    print(f"{'layout':<22}{'s/step':>9}{'tokens/s':>11}")
    ep1 = _run_worker(a, "ours", 2, ep=1)
    print(f"{'ours EP1 x DP2':<22}{ep1:>9.3f}{tokens / ep1:>11.0f}")
    ep2 = _run_worker(a, "ours", 2, ep=2)
    print(f"{'ours EP2 x DP2':<22}{ep2:>9.3f}{tokens / ep2:>11.0f}")
    print(f"EP2 / EP1 step time: {ep2 / ep1:.2f} (tokens/s ratio {ep1 / ep2:.2f})")
    sys.path.insert(0, str(Path(__file__).parent))
    from loop import actor_overhead

    plain = actor_overhead()
    routed = actor_overhead(routed_experts=(48, 8, 128))
    print(f"actor: {plain['ms_per_rollout']:.3f} ms per rollout; with Qwen3-30B-A3B's routed experts "
          f"(48 layers x top-8 of 128) in every answer and record {routed['ms_per_rollout']:.3f} ms "
          f"(+{routed['ms_per_rollout'] - plain['ms_per_rollout']:.3f}"
          f" ms; target < 1 ms; the fake fleet's own {routed['fleet_ms_per_rollout']:.3f} ms left out)")


if __name__ == "__main__":
    main()

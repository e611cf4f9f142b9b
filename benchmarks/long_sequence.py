"""Memory of the trainer's log-prob head: the full logits (``trainer.logprob_chunk_tokens=0``)
against log-probs from hidden states in chunks (the default), forward and backward, at TP1 and TP2.

    PYTHONPATH=. python benchmarks/long_sequence.py [--hidden 128 --chunk 2048]

Each case runs in fresh processes (two gloo ranks at TP2, each with half the vocabulary). A rank
makes its inputs (hidden states ``[T, h]`` of the loss positions, its output-weight slice
``[V/tp, h]``, fp32, as on the CPU path), resets its peak RSS (``/proc/self/clear_refs``), runs
the log-probs, a backward from a weighted sum, and reads the peak (``VmHWM``): the extra memory is
that peak minus the RSS before the call, the gradients of hidden states and weight included (both
paths make them). Prints MiB per case, the worst rank, and the ratio chunked / full at each T.
The hidden size hardly changes the logits' memory and sets the time; 128 keeps the 64K x 128K case
(which only the chunked path is run at) to a couple of minutes.

``--cp-step`` instead times one training step of a small Llama (4 layers, hidden 256, 32K vocabulary)
on one packed row of ``--cp-tokens`` tokens (4 sequences), at CP 1 (one process, 2 threads) and CP 2
(two gloo ranks, 1 thread each, every sequence split in 4 chunks), after one warm-up step: seconds
and peak RSS per rank above the RSS before the step. No assertions: numbers only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = [(4096, 32768), (8192, 32768), (16384, 32768)]
BIG = (65536, 131072)

_RANK = """
import json, os, sys, time, torch, torch.distributed as dist
from megatron_apriel.trainer.logprobs import chunked_head_logprobs, vocab_parallel_logprobs
tokens, vocab, hidden, chunk, tp, rank, init = json.loads(sys.argv[1])
torch.set_num_threads(1 if tp > 1 else 2)
group = None
if tp > 1:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=tp)
    group = dist.group.WORLD
g = torch.Generator().manual_seed(0)
h = torch.randn(tokens, hidden, generator=g).requires_grad_(True)
w = (torch.randn(vocab // tp, hidden, generator=g) * 0.05).requires_grad_(True)
targets = torch.randint(0, vocab, (tokens,), generator=g)
scale = torch.randn(tokens, generator=g)

def kb(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1])

open("/proc/self/clear_refs", "w").write("5")  # the peak RSS starts again from now
before, began = kb("VmRSS:"), time.perf_counter()
if chunk:
    logp, _ = chunked_head_logprobs(h, w, targets, vocab_size=vocab, chunk_tokens=chunk, tp_group=group, tp_rank=rank)
else:
    logits = torch.nn.functional.linear(h, w)
    logp, _ = vocab_parallel_logprobs(logits, targets, vocab_size=vocab, tp_group=group, tp_rank=rank)
    del logits
(logp * scale).sum().backward()
seconds = time.perf_counter() - began
print(json.dumps({"extra_mib": (kb("VmHWM:") - before) / 1024, "seconds": seconds,
                  "logp_sum": float(logp.detach().sum())}))
"""


def run_case(tokens: int, vocab: int, hidden: int, chunk: int, tp: int) -> dict:
    """Worst rank's extra MiB and seconds (each rank a fresh process)."""
    with tempfile.TemporaryDirectory() as tmp:
        init = str(Path(tmp) / "rendezvous")
        env = dict(os.environ, OMP_NUM_THREADS="1" if tp > 1 else "2")
        procs = [subprocess.Popen([sys.executable, "-c", _RANK,
                                   json.dumps([tokens, vocab, hidden, chunk, tp, r, init])],
                                  stdout=subprocess.PIPE, text=True, env=env) for r in range(tp)]
        outs = []
        for p in procs:
            out, _ = p.communicate()
            if p.returncode:
                raise SystemExit(f"a rank failed (exit {p.returncode}) at T={tokens}, V={vocab}, chunk={chunk}, "
                                 f"tp={tp}")
            outs.append(json.loads(out.strip().splitlines()[-1]))
    return {"extra_mib": max(o["extra_mib"] for o in outs), "seconds": max(o["seconds"] for o in outs),
            "logp_sum": outs[0]["logp_sum"]}


_CP_RANK = """
import json, os, sys, time, torch
from megatron_apriel.model import ModelArch, ModelConfig, build_model
from megatron_apriel.model.config import OptimConfig
from megatron_apriel.model.wrap import build_optimizer, wrap_model
from megatron_apriel.parallel import ParallelConfig, destroy_parallel, init_parallel
from megatron_apriel.records.samples import TrainSample
from megatron_apriel.trainer.batch import cp_shard, packed_microbatches
from megatron_apriel.trainer.config import LossConfig
from megatron_apriel.trainer.step import train_step
tokens, cp, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
ctx = init_parallel(ParallelConfig(cp=cp))
arch = ModelArch(family="llama", vocab_size=32000, hidden_size=256, ffn_hidden_size=688, num_layers=4, num_heads=8,
                 num_kv_heads=4, head_dim=32, max_position_embeddings=65536)
chunks = wrap_model(build_model(ModelConfig(arch=arch), ctx), ctx)
optimizer, scheduler = build_optimizer(chunks, OptimConfig(lr=1e-4, warmup_steps=0), ctx, total_steps=10)
g = torch.Generator().manual_seed(0)
n = tokens // 4
samples = [TrainSample(torch.randint(0, arch.vocab_size, (n,), generator=g).tolist(), 16, [-2.0] * (n - 16),
                       advantage=float(i % 2) - 0.5) for i in range(4)]
mbs = [cp_shard(mb, cp, ctx.cp_rank) for mb in packed_microbatches(samples, [0, 1, 2, 3], tokens, align=2 * cp)]
loss = LossConfig()
def kb(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1])
step = dict(optimizer=optimizer, scheduler=scheduler, ctx=ctx, cfg=loss, vocab_size=arch.vocab_size)
train_step(chunks, mbs, **step)  # warm-up
open("/proc/self/clear_refs", "w").write("5")
before, began = kb("VmRSS:"), time.perf_counter()
metrics = train_step(chunks, mbs, **step)
seconds = time.perf_counter() - began
with open(f"{out}.{ctx.rank}", "w") as f:
    json.dump({"seconds": seconds, "extra_mib": (kb("VmHWM:") - before) / 1024,
               "grad_norm": metrics["train/grad_norm"]}, f)
destroy_parallel()
"""


def cp_step(tokens: int) -> None:
    """One training step at CP 1 and CP 2 on the same row; seconds and extra MiB per rank."""
    print(f"one training step, {tokens} tokens in one packed row (4 sequences), small Llama, gloo:")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "cp_rank.py"
        script.write_text(_CP_RANK)
        for cp in (1, 2):
            env = dict(os.environ, OMP_NUM_THREADS=str(2 // cp))
            out = Path(tmp) / f"cp{cp}"
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(cp),
                            str(script), str(tokens), str(cp), str(out)], check=True, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            rows[cp] = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(cp)]
    for cp, ranks in rows.items():
        print(f"  CP {cp}: {max(r['seconds'] for r in ranks):.2f} s, peak extra per rank "
              + ", ".join(f"{r['extra_mib']:.0f} MiB" for r in ranks) + f", grad norm {ranks[0]['grad_norm']:.6f}")
    one, two = rows[1][0], rows[2]
    print(f"  CP 2 / CP 1: time x{max(r['seconds'] for r in two) / one['seconds']:.2f}, "
          f"memory per rank x{max(r['extra_mib'] for r in two) / one['extra_mib']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=2048, help="trainer.logprob_chunk_tokens of the chunked path")
    parser.add_argument("--skip-big", action="store_true", help=f"leave out T={BIG[0]}, V={BIG[1]}")
    parser.add_argument("--cp-step", action="store_true", help="time one training step at CP 1 and CP 2 instead")
    parser.add_argument("--cp-tokens", type=int, default=8192)
    args = parser.parse_args()
    if args.cp_step:
        cp_step(args.cp_tokens)
        return
    print(f"{'T':>6} {'V':>7} {'tp':>3} | {'full MiB':>9} {'chunked MiB':>11} {'ratio':>6} | "
          f"{'full s':>7} {'chunked s':>9}")
    for tp in (1, 2):
        for tokens, vocab in CASES:
            full = run_case(tokens, vocab, args.hidden, 0, tp)
            chunked = run_case(tokens, vocab, args.hidden, args.chunk, tp)
            same = abs(full["logp_sum"] - chunked["logp_sum"]) <= 1e-4 * abs(full["logp_sum"])
            print(f"{tokens:>6} {vocab:>7} {tp:>3} | {full['extra_mib']:>9.0f} {chunked['extra_mib']:>11.0f} "
                  f"{chunked['extra_mib'] / full['extra_mib']:>6.3f} | {full['seconds']:>7.2f} "
                  f"{chunked['seconds']:>9.2f}"
                  + ("" if same else "  (log-prob sums differ!)"), flush=True)
    if not args.skip_big:
        tokens, vocab = BIG
        chunked = run_case(tokens, vocab, args.hidden, args.chunk, 1)
        full_logits_mib = tokens * vocab * 4 / 2 ** 20
        print(f"{tokens:>6} {vocab:>7} {1:>3} | {'-':>9} {chunked['extra_mib']:>11.0f} {'-':>6} | {'-':>7} "
              f"{chunked['seconds']:>9.2f}   (one fp32 copy of the full logits alone: {full_logits_mib:.0f} MiB)")


if __name__ == "__main__":
    main()

"""Our model, log-probs, GSPO loss and one optimizer step on this machine's accelerator vs the CPU.

On a GPU machine (two processes: the CPU reference must run with CUDA hidden, so that the CPU
path is exactly the one the test suite checks):

    CUDA_VISIBLE_DEVICES= python tools/device_check.py --save cpu.pt
    python tools/device_check.py --compare cpu.pt [--out results.json]

One process per call (world size 1). The same tiny model (canonical random weights) and batch run
as CPU fp32 (without CUDA) or as CUDA fp32 and CUDA bf16 (local layer spec; Transformer Engine does
not travel to the device machine). ``--compare`` prints the largest differences of per-token
log-probs, loss and updated weights against the saved CPU fp32 run. Expect ~1e-6 for CUDA fp32.

Then two steps of the real ``Trainer.run`` (the composition root's ``build_trainer``, the local
self-sampling source: the device machine has no vLLM) in each precision, with their metrics side by
side: this runs every collective the trainer issues (stop flag, metric reductions, DP all-reduce)
on the device's backend.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_apriel.convert.mapping import canonical_shapes  # noqa: E402
from megatron_apriel.model import ModelArch, ModelConfig, build_model  # noqa: E402
from megatron_apriel.model.config import OptimConfig
from megatron_apriel.model.state import gather_full_state_dict, load_full_state_dict  # noqa: E402
from megatron_apriel.model.wrap import build_optimizer, wrap_model
from megatron_apriel.parallel import ParallelConfig, init_parallel  # noqa: E402
from megatron_apriel.trainer.batch import TrainSample, packed_microbatches  # noqa: E402
from megatron_apriel.trainer.config import LossConfig
from megatron_apriel.trainer.step import forward_logprobs, train_step  # noqa: E402

ARCH = ModelArch(family="qwen3", vocab_size=1000, hidden_size=128, ffn_hidden_size=256, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=32, qk_norm=True)
LOSS = LossConfig(kind="gspo", eps_low=0.2, eps_high=0.28)
OPTIM = OptimConfig(lr=1e-3, warmup_steps=0, clip_grad=1.0, adam_eps=1e-3)


def reference_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {k: (1 + 0.1 * torch.randn(s, generator=g)) if k.endswith("norm.weight")
            else 0.05 * torch.randn(s, generator=g)
            for k, s in sorted(canonical_shapes(ARCH).items())}


def samples() -> list[TrainSample]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(16):
        plen, clen = 8 + i % 5, 20 + (11 * i) % 40
        toks = torch.randint(0, ARCH.vocab_size, (plen + clen,), generator=g).tolist()
        out.append(TrainSample(toks, plen, (-torch.rand(clen, generator=g) - 6.5).tolist(),
                               advantage=float(torch.randn((), generator=g)), truncated=i == 3))
    return out


def run(ctx, precision: str) -> dict:
    model = build_model(ModelConfig(arch=ARCH, precision=precision, transformer_impl="local",
                                    fp32_lm_head=precision == "bf16"), ctx)
    load_full_state_dict(model, reference_state(), ctx)
    chunks = wrap_model(model, ctx)
    optimizer, scheduler = build_optimizer(chunks, OPTIM, ctx, total_steps=10)
    data = samples()
    mbs = packed_microbatches(data, list(range(len(data))), 256)
    logp = torch.cat([lp[mb.loss_mask]
                      for mb, lp in zip(mbs, forward_logprobs(chunks, mbs, ctx=ctx, vocab_size=ARCH.vocab_size,
                                                                       temperature=1.0))])
    metrics = train_step(chunks, mbs, optimizer=optimizer, scheduler=scheduler, ctx=ctx, cfg=LOSS,
                         vocab_size=ARCH.vocab_size)
    weights = {k: v.float() for k, v in gather_full_state_dict(model, ctx, ARCH.vocab_size).items()}
    return {"logp": logp.float().cpu(), "loss": metrics["train/loss"], "grad_norm": metrics["train/grad_norm"],
            "weights": weights}


def trainer_steps(precision: str, ctx, steps: int = 2) -> list[dict]:
    """``steps`` steps of ``Trainer.run`` on the tiny_local preset, in ``precision``, on this device."""
    import tempfile

    from hydra import compose, initialize_config_module

    from megatron_apriel.config import register_configs, to_run_config
    from megatron_apriel.entrypoints.trainer_rank import build_trainer

    register_configs()
    with tempfile.TemporaryDirectory() as tmp, initialize_config_module("megatron_apriel.conf", version_base=None):
        run = to_run_config(compose("tiny_local", [f"model.precision={precision}", f"trainer.steps={steps}",
                                                   f"run_dir={tmp}", "checkpoint.save_at_end=false",
                                                   "launch.nproc_per_node=1"]))
        trainer = build_trainer(run, ctx)
        try:
            return trainer.run()
        finally:
            trainer.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save", default=None, help="save this machine's runs (torch.save) here")
    p.add_argument("--compare", default=None, help="a --save file whose 'cpu fp32' run is the reference")
    p.add_argument("--out", default=None, help="also write the differences as JSON here")
    args = p.parse_args()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29631")
    ctx = init_parallel(ParallelConfig())
    if torch.cuda.is_available():
        rows = {"cuda fp32": run(ctx, "fp32"), "cuda bf16": run(ctx, "bf16")}
    else:
        rows = {"cpu fp32": run(ctx, "fp32")}
    if args.save:
        torch.save(rows, args.save)
    ref = torch.load(args.compare, weights_only=False)["cpu fp32"] if args.compare else rows.get("cpu fp32")
    if ref is None:
        raise SystemExit("no CPU reference: pass --compare FILE saved by a run with CUDA_VISIBLE_DEVICES= .")
    report = {}
    print(f"{'run':<10}{'max|dlogp|':>12}{'mean|dlogp|':>13}{'loss':>12}{'|dloss|':>10}{'grad_norm':>11}{'max|dW|':>10}")
    for name, r in rows.items():
        dl = (r["logp"] - ref["logp"]).abs()
        dw = max((r["weights"][k] - ref["weights"][k]).abs().max().item() for k in ref["weights"])
        report[name] = {"max_dlogp": dl.max().item(), "mean_dlogp": dl.mean().item(), "loss": r["loss"],
                        "dloss": abs(r["loss"] - ref["loss"]), "grad_norm": r["grad_norm"], "max_dW": dw}
        v = report[name]
        print(f"{name:<10}{v['max_dlogp']:>12.2e}{v['mean_dlogp']:>13.2e}{v['loss']:>12.5f}{v['dloss']:>10.2e}"
              f"{v['grad_norm']:>11.4f}{v['max_dW']:>10.2e}")
    runs = {name: trainer_steps(precision, ctx) for name, precision in
            ((("cuda fp32", "fp32"), ("cuda bf16", "bf16")) if torch.cuda.is_available() else (("cpu fp32", "fp32"),))}
    keys = ("rollout/reward", "train/loss", "train/grad_norm", "train/abs_log_ratio")
    print(f"\nTrainer.run, 2 steps{'':<4}" + "".join(f"{k.split('/')[-1]:>14}" for k in keys))
    for name, history in runs.items():
        for step, m in enumerate(history):
            print(f"{name:<10} step {step:<8}" + "".join(f"{m.get(k, float('nan')):>14.5g}" for k in keys))
        report[f"trainer {name}"] = history
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

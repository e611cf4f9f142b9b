"""A 2-rank Megatron trainer (TP=2 or PP=2; EP=2 for a mixture of experts) that pushes weights to a
running vLLM server.

Launched by tests/vllm/test_weight_sync_vllm.py (and, EP 2 with ``--pushes 1``, by
tests/vllm/test_moe_routes_across_versions.py) as
``torchrun --nproc_per_node 2 weight_sync_push.py --layout tp2|pp2|ep2 --server URL --model DIR --work DIR``.
Steps, each gated by a file the test writes into ``--work`` (so it can run requests around them):
1. connect, write ``ready``;
2. on ``go1``: load perturbed weights, push them as ``--version``, save the trainer's log-probs of
   the fixed prompts and the report to ``step1.pt``, write ``done1`` (``--pushes 1``: then exit);
3. on ``go2``: load other weights, push them as ``--version + 1`` with one byte flipped on the wire
   after its checksum was taken (tp2: in a direct bucket, the zero-copy path; pp2: in a packed
   one), save the report to ``step2.pt``, write ``done2``.
"""

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron_apriel.convert.hf_io import HFReader
from megatron_apriel.convert.mapping import detect_layout, hf_to_canonical
from megatron_apriel.model import ModelArch, ModelConfig, build_model
from megatron_apriel.model.state import load_full_state_dict
from megatron_apriel.parallel import ParallelConfig, destroy_parallel, init_parallel
from megatron_apriel.trainer.batch import TrainSample, padded_microbatches
from megatron_apriel.trainer.step import forward_logprobs
from megatron_apriel.weight_sync.config import WeightSyncConfig
from megatron_apriel.weight_sync.sender import WeightSender
from megatron_apriel.weight_sync.gather import table_to_hf

PROMPTS = [[5, 17, 99, 3, 250, 7, 64, 8], [300, 2, 41, 41, 41, 900, 12], [1000, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


def wait_for(path: Path, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)


def base_canonical(model_dir: str, arch: ModelArch) -> dict:
    """The served checkpoint's tensors, canonical (any key layout: a MoE's experts stacked or not)."""
    reader = HFReader(model_dir)
    layout = detect_layout(reader.files.keys(), reader.config)
    with reader:
        hf = {name: reader.get(key) for key in reader.files if (name := layout.to_plain(key)) is not None}
    return hf_to_canonical(hf, arch), layout


def perturbed(canonical: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in canonical.items()}


def trainer_logprobs(model, ctx, vocab_size: int) -> list[list[float]]:
    """Log-prob of every prompt token after the first, as the trainer computes it (temperature 1)."""
    samples = [TrainSample(p, 1, [0.0] * (len(p) - 1), advantage=0.0) for p in PROMPTS]
    mbs = padded_microbatches(samples, list(range(len(samples))), len(samples), 16)
    out = forward_logprobs([model], mbs, ctx=ctx, vocab_size=vocab_size, temperature=1.0)
    if not ctx.is_last_stage:
        return []
    logp, mb = out[0], mbs[0]
    return [logp[i][mb.loss_mask[i]].tolist() for i in range(len(samples))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", choices=["tp2", "pp2", "ep2"], required=True)
    ap.add_argument("--pushes", type=int, choices=[1, 2], default=2, help="1: the first push only")
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--version", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--bucket-bytes", type=int, default=64 * 1024)
    ap.add_argument("--direct-bytes", type=int, default=256 * 1024)  # the tiny model's embedding and lm_head
    ap.add_argument("--keep-kv", action="store_true", help="fleet.kv_on_update=keep: the pause keeps the KV cache")
    args = ap.parse_args()
    work = Path(args.work)
    tp, pp, ep = {"tp2": (2, 1, 1), "pp2": (1, 2, 1), "ep2": (1, 1, 2)}[args.layout]
    ctx = init_parallel(ParallelConfig(tp=tp, pp=pp, ep=ep))
    arch = ModelArch.from_hf_dir(args.model)
    model = build_model(ModelConfig(hf_path=args.model), ctx)
    base, layout = base_canonical(args.model, arch)
    sender = WeightSender(WeightSyncConfig(bucket_bytes=args.bucket_bytes, direct_bytes=args.direct_bytes,
                                           advertise_host="127.0.0.1",
                                           base_port=args.port, timeout_s=120),
                          members=[args.server], model=model, ctx=ctx, vocab_size=arch.vocab_size,
                          to_hf=table_to_hf(arch, layout), keep_kv=args.keep_kv)
    sender.ensure_connected()
    rank = dist.get_rank()
    if rank == 0:
        (work / "ready").touch()

    wait_for(work / "go1")
    load_full_state_dict(model, perturbed(base, args.version), ctx)
    report = sender.push(args.version)
    logps = trainer_logprobs(model, ctx, arch.vocab_size)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, logps)
    if rank == 0:
        torch.save({"report": report.model_dump(), "logprobs": [g for g in gathered if g][0]}, work / "step1.pt")
        (work / "done1").touch()
    if args.pushes == 1:
        sender.close()
        destroy_parallel()
        return

    wait_for(work / "go2")
    load_full_state_dict(model, perturbed(base, args.version + 1), ctx)
    corrupt_stage, direct = ctx.dims.pp - 1, args.layout == "tp2"
    flipped: list[int] = []

    def flip(stage: int, layout, data: torch.Tensor):
        if stage != corrupt_stage or layout.direct != direct or flipped:
            return None
        flipped.append(layout.index)
        bad = data.clone()  # a direct bucket's bytes are the model's own tensor
        bad[-1 if direct else 100] ^= 0x10
        return bad

    sender.on_bucket = flip
    report2 = sender.push(args.version + 1)
    if rank == 0:
        torch.save({"report": report2.model_dump()}, work / "step2.pt")
        (work / "done2").touch()
    sender.close()
    destroy_parallel()


if __name__ == "__main__":
    main()

"""``apriel-convert``: Hugging Face <-> Megatron distributed checkpoint conversion.

    apriel-convert hf-to-mcore --hf PATH --out PATH [--tp N --pp N --ep N]
    apriel-convert mcore-to-hf --mcore PATH --out PATH [--hf-reference PATH]

Runs as one process (no torchrun): memory stays at about one decoder layer.
"""

from __future__ import annotations

import argparse
import sys

from megatron_apriel.convert.checkpoint import hf_to_mcore, mcore_to_hf
from megatron_apriel.refusals import REFUSALS, refuse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="apriel-convert", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    h2m = sub.add_parser("hf-to-mcore", help="HF safetensors -> Megatron distributed checkpoint")
    h2m.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    h2m.add_argument("--out", required=True, help="output directory (must not exist)")
    h2m.add_argument("--tp", type=int, default=1, help="tensor-parallel size to check and pad the vocab for")
    h2m.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to check")
    h2m.add_argument("--ep", type=int, default=1,
                     help="expert-parallel size to check (MoE; the checkpoint loads at any EP)")
    m2h = sub.add_parser("mcore-to-hf", help="Megatron distributed checkpoint (any TP/PP/EP) -> HF safetensors")
    m2h.add_argument("--mcore", required=True, help="dist checkpoint directory (holds metadata.json)")
    m2h.add_argument("--out", required=True, help="output directory (must not exist)")
    m2h.add_argument("--hf-reference", default=None,
                     help="HF model to take the key layout, dtypes, vision tower, config and tokenizer from")
    m2h.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size limit")
    for p in (h2m, m2h):
        p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "hf-to-mcore":
            if min(args.tp, args.pp, args.ep) < 1:
                raise ValueError(f"--tp, --pp and --ep must be >= 1, got {args.tp}, {args.pp} and {args.ep}.")
            hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep, progress=not args.no_progress)
        else:
            mcore_to_hf(args.mcore, args.out, hf_reference=args.hf_reference,
                        max_shard_bytes=int(args.max_shard_gb * 2**30), progress=not args.no_progress)
    except REFUSALS as err:
        refuse(f"apriel-convert {args.command}", err)
    print(f"apriel-convert {args.command}: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``apriel-plan``: trainer and rollout-fleet layouts for a base model on a cluster.

    apriel-plan --preset llama3_70b --nodes 8 --gpus-per-node 8 --gpu-memory-gb 80
    apriel-plan --hf /models/Qwen2.5-32B --nodes 16 --gpus-per-node 8 --gpu-memory-gb 80 --json

``--preset NAME`` takes the run settings (sequence length, precision, group size, ...) from
``conf/NAME.yaml`` and, unless ``--hf`` is given, the model from ``conf/models/NAME/config.json``.
With ``--hf`` alone the paper's recipe (``apriel_15b``) gives the run settings. Weights,
gradients and optimizer state follow Megatron's buffers and distributed optimizer element by
element (tested to the byte for the local spec on CPU, expert buffers included; the Transformer
Engine spec's layout is modelled the same way, with its norms fused into the linears and its
grouped experts); activations and the log-prob head are estimates (a MoE layer's from balanced
routing, its dispatcher's buffers not counted). For a mixture of experts every expert-parallel
size that divides the experts and tp * dp is sized too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from megatron_apriel.model.arch import ModelArch
from megatron_apriel.plan.layouts import TrainerSettings, plan_layouts, recommend
from megatron_apriel.plan.params import parameter_count
from megatron_apriel.plan.report import render_text
from megatron_apriel.plan.servers import plan_fleet, stage_update_bytes, weights_bytes
from megatron_apriel.refusals import REFUSALS, refuse

CONF = Path(__file__).resolve().parents[1] / "conf"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="apriel-plan", description=__doc__.split("\n")[0])
    p.add_argument("--hf", help="HF model directory (its config.json is read; no weights needed)")
    p.add_argument("--preset", help="run preset in megatron_apriel/conf (default: apriel_15b for run settings)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="Hydra override of the preset, e.g. trainer.seq_len=32768 (repeatable)")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--gpu-memory-gb", type=float, required=True, help="memory of one GPU in GiB (H100: 80)")
    p.add_argument("--trainer-nodes", type=int, help="nodes for the trainer (default: half); the rest serve vLLM")
    p.add_argument("--trainer-gpus", type=int,
                   help="with --nodes 1: GPUs for the trainer (default: half, else the split closest to half "
                        "where both fit); the rest of the node serves vLLM")
    p.add_argument("--headroom-gb", type=float, default=6.0,
                   help="per GPU, kept free for the CUDA context, NCCL buffers and fragmentation")
    p.add_argument("--bandwidth-gbps", type=float, default=100.0,
                   help="trainer-to-fleet bandwidth per pipeline stage, Gbit/s")
    p.add_argument("--json", action="store_true", help="print the same figures as JSON")
    return p


def _bundled(preset: str) -> Path | None:
    """``conf/models/<preset>``, or that of the preset it builds on (its defaults list: a long-budget
    preset plans its parent's base)."""
    if (CONF / "models" / preset / "config.json").is_file():
        return CONF / "models" / preset
    path = CONF / f"{preset}.yaml"
    parents = (yaml.safe_load(path.read_text()) or {}).get("defaults", []) if path.is_file() else []
    for parent in (p for p in parents if isinstance(p, str) and (CONF / f"{p}.yaml").is_file()):
        if found := _bundled(parent):
            return found
    return None


def _model_dir(args) -> Path:
    if args.hf:
        return Path(args.hf)
    found = _bundled(args.preset)
    if found is None:
        raise ValueError(f"preset {args.preset!r} has no bundled model config "
                         f"({CONF / 'models' / args.preset / 'config.json'}); pass --hf DIR.")
    return found


def load_run(preset: str, model_dir: Path, overrides: list[str]):
    """The preset's validated RunConfig, with mandatory paths filled in for planning only."""
    from omegaconf import OmegaConf

    from megatron_apriel.config import compose_config, to_run_config

    cfg = compose_config(preset, [f"model.hf_path={model_dir}", *overrides])
    if OmegaConf.is_missing(cfg.actor, "data"):  # the problem files do not change the sizes
        cfg.actor.data = ["planning-only"]
    return to_run_config(cfg)


def _fleet(arch, run, args, gpus: int):
    """The vLLM fleet on ``gpus`` GPUs (a ValueError when no server fits)."""
    return plan_fleet(arch, gpus=gpus, gpus_per_node=min(args.gpus_per_node, gpus), gpu_memory_gib=args.gpu_memory_gb,
                      memory_utilization=run.fleet.server_args.gpu_memory_utilization,
                      seq_len=run.trainer.seq_len, min_sequences=run.rollout.group_size)


def _size(arch, settings, run, args, usable, trainer_gpus: int, trainer_gpus_per_node: int, fleet_gpus: int):
    """(the trainer's layouts, the recommended one or None, the fleet's plan) for this split."""
    layouts = plan_layouts(arch, trainer_gpus, trainer_gpus_per_node, settings, usable)
    return layouts, recommend(layouts), _fleet(arch, run, args, fleet_gpus)


def _one_node(arch, settings, run, args, usable):
    """One node shared by the trainer and the fleet (``launch.gpus_per_node``): ``--trainer-gpus``, or
    the split closest to half (more trainer GPUs first) where a trainer layout fits and the rest holds
    a vLLM server. (trainer GPUs, `_size`'s result)."""
    gpus = args.gpus_per_node
    if args.trainer_gpus is not None:
        if not 1 <= args.trainer_gpus < gpus:
            raise ValueError(f"--trainer-gpus={args.trainer_gpus} must leave the fleet at least one of the node's "
                             f"{gpus} GPUs (--gpus-per-node) and keep one for the trainer.")
        return args.trainer_gpus, _size(arch, settings, run, args, usable, args.trainer_gpus, args.trainer_gpus,
                                        gpus - args.trainer_gpus)
    half = max(1, gpus // 2)
    trainer_fits, fleet_fits = [], []
    for trainer in [half, *range(half + 1, gpus), *range(half - 1, 0, -1)]:
        layouts = plan_layouts(arch, trainer, trainer, settings, usable)
        best = recommend(layouts)
        try:
            fleet = _fleet(arch, run, args, gpus - trainer)
        except ValueError:  # no vLLM server fits in what is left
            fleet = None
        if best is not None and fleet is not None:
            return trainer, (layouts, best, fleet)
        trainer_fits += [trainer] if best is not None else []
        fleet_fits += [gpus - trainer] if fleet is not None else []
    raise ValueError(
        f"the model does not fit one node of {gpus} x {args.gpu_memory_gb:g} GiB: the trainer needs "
        f"{min(trainer_fits) if trainer_fits else f'more than {gpus - 1}'} GPUs and a vLLM server "
        f"{min(fleet_fits) if fleet_fits else f'more than {gpus - 1}'}, together more than {gpus}. Use two or more "
        "nodes (--nodes 2), larger GPUs, or a lower trainer.seq_len.")


def make_plan(args) -> dict:
    for name in ("nodes", "gpus_per_node"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1.")
    if not args.hf and not args.preset:
        raise ValueError("give the model: --hf DIR (an HF config.json) or --preset NAME.")
    preset = args.preset or "apriel_15b"
    if not (CONF / f"{preset}.yaml").is_file():
        raise ValueError(f"no preset {preset!r}; choose one of {sorted(p.stem for p in CONF.glob('*.yaml'))}.")
    model_dir = _model_dir(args)
    arch = ModelArch.from_hf_dir(model_dir)
    run = load_run(preset, model_dir, args.override)
    arch.check_sequence_length(run.trainer.seq_len)
    if not run.optim.distributed_optimizer:
        raise ValueError("the planner sizes Megatron's distributed optimizer; set optim.distributed_optimizer=true.")
    settings = TrainerSettings(seq_len=run.trainer.seq_len, param_bytes=4 if run.model.precision == "fp32" else 2,
                               sequence_parallel=run.parallel.sequence_parallel,
                               vocab_divisible_by=run.model.make_vocab_size_divisible_by,
                               logprob_chunk_tokens=run.trainer.logprob_chunk_tokens)
    usable = args.gpu_memory_gb - args.headroom_gb
    if args.nodes == 1:
        trainer_gpus, (layouts, best, fleet) = _one_node(arch, settings, run, args, usable)
        trainer_nodes = fleet_nodes = 1
    else:
        trainer_nodes = args.trainer_nodes or max(1, args.nodes // 2)
        if not 1 <= trainer_nodes < args.nodes:
            raise ValueError(f"--trainer-nodes={trainer_nodes} leaves no node for vLLM out of --nodes={args.nodes}; "
                             "give more nodes or fewer trainer nodes (or --nodes 1 to share one node).")
        trainer_gpus, fleet_nodes = trainer_nodes * args.gpus_per_node, args.nodes - trainer_nodes
        layouts, best, fleet = _size(arch, settings, run, args, usable, trainer_gpus, args.gpus_per_node,
                                     fleet_nodes * args.gpus_per_node)
    pp, ep = (best[0].pp, best[0].ep) if best else (1, 1)
    update = stage_update_bytes(arch, pp, ep)
    seconds = [b * 8 / (args.bandwidth_gbps * 1e9) for b in update]
    return {
        "model": {"dir": str(model_dir), "family": arch.family, "parameters": parameter_count(arch),
                  "active_parameters": parameter_count(arch, active=True),
                  "experts": arch.num_experts, "top_k": arch.moe_top_k,
                  "bf16_weights_gib": weights_bytes(arch) / 2**30, "layers": arch.num_layers},
        "cluster": {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node, "gpu_memory_gib": args.gpu_memory_gb,
                    "usable_gib": usable, "trainer_nodes": trainer_nodes, "fleet_nodes": fleet_nodes,
                    "trainer_gpus": trainer_gpus,
                    "fleet_gpus": args.nodes * args.gpus_per_node - trainer_gpus},
        "run": {"preset": preset, "seq_len": run.trainer.seq_len,
                "param_bytes": settings.param_bytes, "sequence_parallel": settings.sequence_parallel,
                "group_size": run.rollout.group_size,
                "sequences_in_flight": run.actor.max_in_flight * run.rollout.group_size},
        "layouts": [lay.to_dict() for lay in layouts],
        "recommended": None if best is None else {"tp": best[0].tp, "pp": best[0].pp, "dp": best[0].dp,
                                                   "ep": best[0].ep, "cp": best[0].cp, "recompute": best[1],
                                                   "total_gib": best[0].total_gib[best[1]]},
        "fleet": fleet.to_dict(),
        "weight_update": {"pp": pp, "ep": ep, "bytes_per_stage": update, "seconds_per_stage": seconds,
                          "bandwidth_gbps": args.bandwidth_gbps},
        "estimates": ["activations", "logits"] + (["moe dispatcher buffers (not counted)"] if arch.is_moe else []),
        "one_node_launch": one_node_overrides(run, args.gpus_per_node, trainer_gpus, fleet, best, arch.is_moe)
        if args.nodes == 1 and best else None,
    }


def one_node_overrides(run, gpus: int, trainer_gpus: int, fleet, best, moe: bool) -> list[str]:
    """``apriel-train`` (and ``apriel-submit``) overrides that run the plan's split on one node
    (``launch.gpus_per_node``): the preset's own vLLM flags with the planned --tensor-parallel-size,
    and the recommended layout."""
    from megatron_apriel.fleet.config import ServerArgs

    flags = ServerArgs(tuple(run.fleet.vllm_args)).without("--tensor-parallel-size", "-tp").argv
    flags += ("--tensor-parallel-size", str(fleet.tp_per_server))
    layout, recompute = best
    out = ["launch.nnodes=1", f"launch.gpus_per_node={gpus}", f"launch.nproc_per_node={trainer_gpus}",
           f"fleet.num_servers={fleet.servers}", "fleet.vllm_args=[" + ",".join(f'"{a}"' for a in flags) + "]",
           f"parallel.tp={layout.tp}", f"parallel.pp={layout.pp}", f"parallel.cp={layout.cp}",
           f"model.recompute={'null' if recompute == 'none' else recompute}", f"slurm.gpus_per_node={gpus}"]
    return out + ([f"parallel.ep={layout.ep}"] if moe else [])


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        plan = make_plan(args)
    except REFUSALS as err:
        refuse("apriel-plan", err)
    print(json.dumps(plan, indent=2) if args.json else render_text(plan))
    return 0 if plan["recommended"] else 1


if __name__ == "__main__":
    sys.exit(main())

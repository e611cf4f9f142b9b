"""The dry run's report (``launch.dry_run=true``): the model, the layout, the loop's settings and the
command line of every process the launch would start."""

from __future__ import annotations

import math
from pathlib import Path

from megatron_apriel.config import RunConfig
from megatron_apriel.launch.components import Component, device_split


def _devices(c: Component) -> str:
    """The process's own GPUs, as a shell would set them before its command."""
    devices = c.env.get("CUDA_VISIBLE_DEVICES")
    return "" if devices is None else f"CUDA_VISIBLE_DEVICES={devices} "


def describe(run: RunConfig, components: list[Component]) -> str:
    from megatron_apriel.convert.mapping import canonical_shapes
    from megatron_apriel.parallel.dims import ParallelDims

    known = run.model.hf_path is None or (Path(run.model.hf_path) / "config.json").is_file()  # tiny base: not built yet
    arch = run.model.resolve_arch() if known else None
    lines = [f"run_dir: {run.run_dir}"]
    if arch is not None:
        arch.check_sequence_length(run.trainer.seq_len)
        params = sum(math.prod(s) for s in canonical_shapes(arch).values())
        experts = (f", {arch.num_experts} experts top-{arch.moe_top_k} in {len(arch.moe_layers)} layers"
                   if arch.is_moe else "")
        lines.append(f"model: {run.model.hf_path or 'inline arch'} ({arch.family}, {arch.num_layers} layers, hidden "
                     f"{arch.hidden_size}{experts}, {params / 1e9:.2f}B parameters)")
    world = run.launch.nnodes * run.launch.nproc_per_node
    dims = ParallelDims.resolve(run.parallel, world)
    lines.append(f"trainer: {run.launch.nnodes} node(s) x {run.launch.nproc_per_node} rank(s) = TP {dims.tp} x "
                 f"PP {dims.pp} x DP {dims.dp}{f' (experts: EP {dims.ep})' if dims.ep > 1 else ''}; "
                 f"{run.trainer.steps} steps of {run.rollout.groups_per_step} groups x G={run.rollout.group_size}; "
                 f"seq_len {run.trainer.seq_len}, packing={run.trainer.packing}")
    if run.rollout.source == "fleet":
        lines.append(f"rollouts: vLLM fleet -> actor -> {run.run_dir}/rollouts; budget {run.rewards.max_len} tokens, "
                     f"temperature {run.loss.temperature}, max_lag {run.rollout.max_lag}, "
                     f"mix {run.actor.sampler.mix} (actor.sampler.count={run.actor.sampler.count})"
                     f"{', routing replay' if run.rollout.routing_replay and dims.ep and arch and arch.is_moe else ''}")
        lines.append(f"weight sync: every step, backend {run.weight_sync.backend}, buckets of "
                     f"{run.weight_sync.bucket_bytes / 2**20:.0f} MiB, "
                     + (f"stage ports from {run.weight_sync.base_port}" if run.weight_sync.base_port
                        else "stage ports chosen free"))
        if run.fleet.servers:
            lines.append(f"servers (already running): {run.fleet.servers}")
    lines.append("processes:")
    lines += [f"  {c.name:<9} {_devices(c)}{' '.join(c.cmd)}" for c in components]
    split = device_split(run)
    if split is not None and split.idle:
        lines.append(f"idle GPUs: {','.join(split.idle)} (launch.gpus_per_node={run.launch.gpus_per_node})")
    return "\n".join(lines)

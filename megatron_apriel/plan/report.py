"""The text form of ``apriel-plan``'s figures (the JSON form is the plan dict itself)."""

from __future__ import annotations

import shlex

GB_FMT = "{:6.1f}"


def _row(lay: dict) -> str:
    act = lay["activations_gib"]
    cells = [f"{lay['tp']:>3} {lay['cp']:>3} {lay['pp']:>3} {lay['dp']:>4} {lay['ep']:>3}"]
    cells += [GB_FMT.format(lay[k]) for k in ("weights_gib", "grads_gib", "optimizer_gib")]
    cells += [GB_FMT.format(act[r]) for r in ("none", "selective", "full")] + [GB_FMT.format(lay["logits_gib"])]
    cells += [GB_FMT.format(lay["total_gib"][r]) for r in ("none", "selective", "full")]
    return "  ".join(cells) + "  " + (",".join(lay["fits"]) or "-")


def _cluster(c: dict) -> str:
    if c["nodes"] == 1:
        split = f"one node shared: trainer {c['trainer_gpus']} GPUs, vLLM fleet {c['fleet_gpus']} GPUs"
    else:
        split = f"trainer {c['trainer_nodes']} nodes, vLLM fleet {c['fleet_nodes']} nodes"
    nodes = f"{c['nodes']} node{'s' if c['nodes'] > 1 else ''}"
    return (f"cluster: {nodes} x {c['gpus_per_node']} GPUs x {c['gpu_memory_gib']:g} GiB; {split}; "
            f"usable per GPU {c['usable_gib']:g} GiB")


def render_text(plan: dict) -> str:
    m, c, r = plan["model"], plan["cluster"], plan["run"]
    experts = (f", {m['experts']} experts top-{m['top_k']}: {m['active_parameters'] / 1e9:.2f}B active per token"
               if m["experts"] else "")
    lines = [
        f"model: {m['dir']} ({m['family']}, {m['parameters'] / 1e9:.2f}B parameters{experts}, {m['layers']} layers, "
        f"{m['bf16_weights_gib']:.1f} GiB in bf16)",
        _cluster(c),
        f"run: preset {r['preset']}, trainer.seq_len {r['seq_len']} tokens per micro-batch, "
        f"{'bf16' if r['param_bytes'] == 2 else 'fp32'} weights, fp32 grads, distributed optimizer, "
        f"sequence parallel {'on' if r['sequence_parallel'] else 'off'} (tp > 1)",
        "",
        "trainer layouts, GiB per GPU (worst stage, worst DP rank); act. and logits are ESTIMATES:",
        " tp  cp  pp   dp  ep  weight   grad  optim  act:none    sel   full  logits  tot:none    sel   full  fits",
    ]
    lines += [_row(lay) for lay in plan["layouts"]]
    best = plan["recommended"]
    lines.append("")
    if best:
        rec = best["recompute"]
        ep = f" parallel.ep={best['ep']}" if m["experts"] else ""
        cp = f" parallel.cp={best['cp']}" if best["cp"] > 1 else ""
        lines.append(f"recommended: parallel.tp={best['tp']}{cp} parallel.pp={best['pp']}{ep} (dp {best['dp']}), "
                     f"model.recompute={'null' if rec == 'none' else rec}: {best['total_gib']:.1f} GiB per GPU")
    else:
        lines.append("recommended: none fits; add trainer nodes, lower trainer.seq_len or use larger GPUs")
    f, u = plan["fleet"], plan["weight_update"]
    sources = f" x ep {u['ep']} sources" if m["experts"] else ""
    lines += [
        f"vLLM fleet: {f['servers']} servers x TP {f['tp_per_server']} (--tensor-parallel-size {f['tp_per_server']}); "
        f"per GPU {f['weights_per_gpu_gib']:.1f} GiB weights + {f['kv_cache_per_server_gib']:.1f} GiB KV cache; "
        f"{f['kv_bytes_per_token'] / 2**20:.3f} MiB KV per token -> {f['full_sequences_per_server']} sequences of "
        f"{r['seq_len']} tokens per server, {f['fleet_full_sequences']} in the fleet "
        f"(actor keeps up to {r['sequences_in_flight']} in flight, mostly shorter)",
        f"weight update (pp {u['pp']}{sources}, bf16, "
        f"sources in parallel at {u['bandwidth_gbps']:g} Gbit/s): "
        + ", ".join(f"stage {i}: {b / 2**30:.1f} GiB {s:.1f} s" for i, (b, s) in
                    enumerate(zip(u["bytes_per_stage"], u["seconds_per_stage"]))),
    ]
    if plan.get("one_node_launch"):  # the split's keys, for the local launch and the one-node SLURM job
        keys = " ".join(shlex.quote(o) for o in plan["one_node_launch"])
        lines.append(f"one-node launch: apriel-train --config-name PRESET ... {keys}")
        lines.append(f"one-node SLURM job: apriel-submit --config-name PRESET ... {keys}")
    return "\n".join(lines)

"""The steps of the SLURM job (``slurm/train.sbatch``) that need the run's config. ``prepare`` is
the job's launcher: it composes the run once and writes it to ``run_dir/config.yaml``; every other
step, the actor and the trainer ranks read that file:

    python -m megatron_apriel.entrypoints.job_step prepare --facts FILE --train-nodes 4 --train-tasks-per-node 8 \\
        --rollout-nodes 4 --servers-per-node 8 --config-name apriel_15b [overrides]
    # one srun task per server:
    python -m megatron_apriel.entrypoints.job_step serve --run-dir RUN_DIR
    python -m megatron_apriel.entrypoints.job_step export --run-dir RUN_DIR

- ``prepare`` (once per attempt, before anything starts): the run's config (a requeued attempt
  reads the saved one, with the job's overrides applied again: the same run), the allocation
  against it, the launcher's own input checks (data rows, budgets) and the tiny base model when
  the config builds one (``tiny_base.enabled``); writes the config; removes the fleet
  registrations an earlier attempt left; writes the facts the job script needs (``APRIEL_STEPS``)
  as shell assignments into ``--facts``.
- ``serve`` (one task per server): server ``SLURM_LOCALID`` of this node listens on
  ``APRIEL_SERVER_PORT + SLURM_LOCALID``, registers under this node's address (``APRIEL_NODE_ADDRS``
  maps node names to SLURM's NodeAddr) and, on GPU nodes, gets its own slice of the node's GPUs
  (on a node shared with the trainer, ``APRIEL_ONE_NODE=1``: its share of the split that
  ``launch.gpus_per_node`` describes, as the local launch gives it; the trainer's ranks narrow
  themselves to theirs, ``entrypoints/trainer_rank.py``);
  then becomes ``apriel-serve`` with the run's vLLM flags (exec), which supervises its vLLM server:
  nothing the server starts outlives the task, even when the server is killed.
- ``export``: the newest checkpoint to ``run_dir/hf`` (``launch.export_hf``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megatron_apriel.config import launch_config, load_run_config, save_run_config
from megatron_apriel.refusals import REFUSALS, refuse
from megatron_apriel.slurm.layout import ONE_NODE_ENV, node_address, one_node_split


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_apriel.entrypoints.job_step",
                                description=__doc__.split("\n")[0])
    p.add_argument("step", choices=["prepare", "serve", "export"])
    p.add_argument("--config-name", default=None, help="prepare: the run's preset")
    p.add_argument("--config-dir", default=None, help="prepare: a directory of your own presets")
    p.add_argument("--run-dir", default=None, help="serve, export: the run directory prepare wrote the config into")
    p.add_argument("--facts", default=None, help="prepare: write the job's facts here (shell assignments)")
    p.add_argument("--one-node", action="store_true",
                   help="prepare: the trainer and the fleet share the job's one node (APRIEL_ONE_NODE=1)")
    for name in ("train-nodes", "train-tasks-per-node", "rollout-nodes", "servers-per-node"):
        p.add_argument(f"--{name}", type=int, default=None, help="prepare: what the allocation holds")
    return p


def prepare(run, args) -> None:
    from megatron_apriel.launch.preflight import preflight
    from megatron_apriel.slurm.layout import check_allocation

    missing = [n for n in ("facts", "train_nodes", "train_tasks_per_node", "rollout_nodes", "servers_per_node")
               if getattr(args, n) is None]
    if missing:
        raise ValueError(f"prepare needs --{' --'.join(m.replace('_', '-') for m in missing)}.")
    layout = check_allocation(run, args.train_nodes, args.train_tasks_per_node, args.rollout_nodes,
                              args.servers_per_node, args.one_node)
    preflight(run)
    save_run_config(run)
    stale = run.paths.clear_registrations()  # servers of an earlier attempt: dead, their URLs may be reused
    facts = {"APRIEL_STEPS": run.trainer.steps, "APRIEL_NUM_SERVERS": layout.num_servers}
    Path(args.facts).write_text("".join(f"{k}={v}\n" for k, v in facts.items()))
    print(f"prepare: allocation matches the config ({layout.train_nodes} x {layout.train_tasks_per_node} trainer "
          f"ranks, {layout.rollout_nodes} x {layout.servers_per_node} servers); inputs checked; "
          f"{len(stale)} stale fleet registration(s) removed", flush=True)
    if layout.one_node:
        split = one_node_split(run, None)
        print(f"prepare: one node, {run.launch.gpus_per_node} GPUs (positions in each step's CUDA_VISIBLE_DEVICES): "
              f"servers {' | '.join(split.servers)}, trainer {split.trainer}"
              + (f", idle {','.join(split.idle)}" if split.idle else ""), flush=True)


def gpu_slice(local_id: int, servers_per_node: int, gpus_per_node: int, visible: str | None) -> str:
    """The CUDA_VISIBLE_DEVICES of server ``local_id`` of its node: an equal, disjoint share."""
    devices = visible.split(",") if visible else [str(i) for i in range(gpus_per_node)]
    per = len(devices) // servers_per_node
    if per < 1:
        raise ValueError(f"{servers_per_node} servers per node but only {len(devices)} GPUs visible ({devices}).")
    return ",".join(devices[local_id * per:(local_id + 1) * per])


def serve(run) -> None:
    from megatron_apriel.fleet.registry import serve_command
    from megatron_apriel.launch.components import server_flags

    env = os.environ
    local = int(env["SLURM_LOCALID"])
    port = int(env["APRIEL_SERVER_PORT"]) + local
    addr = node_address(env["APRIEL_NODE_ADDRS"], env["SLURMD_NODENAME"])
    gpus, per_node = int(env.get("APRIEL_GPUS_PER_NODE", "0")), int(env["APRIEL_SERVERS_PER_NODE"])
    child_env = dict(env)
    if env.get(ONE_NODE_ENV) == "1":
        child_env["CUDA_VISIBLE_DEVICES"] = one_node_split(run, env.get("CUDA_VISIBLE_DEVICES")).servers[
            int(env["SLURM_PROCID"])]
    elif gpus:
        child_env["CUDA_VISIBLE_DEVICES"] = gpu_slice(local, per_node, gpus, env.get("CUDA_VISIBLE_DEVICES"))
    cmd = serve_command(run.model.hf_path, port, "0.0.0.0", server_flags(run, int(env["SLURM_PROCID"])),
                        register_dir=run.paths.fleet) + ["--advertise-host", addr]
    gpus_shown = f", GPUs {child_env['CUDA_VISIBLE_DEVICES']}" if "CUDA_VISIBLE_DEVICES" in child_env else ""
    print(f"serve: server {env.get('SLURM_PROCID')} on {env['SLURMD_NODENAME']} ({addr}:{port}){gpus_shown}"
          f"\n  {' '.join(cmd)}", flush=True)
    os.execvpe(cmd[0], cmd, child_env)


def export(run) -> None:
    from megatron_apriel.launch.export import export_hf

    if not run.launch.export_hf:
        print("export: launch.export_hf=false, nothing to do")
        return
    out = export_hf(run)
    print(f"export: {'wrote ' + str(out) if out else 'no checkpoint to export'}", flush=True)


def run_config(args, overrides: list[str]):
    """prepare: composed once (or the saved run's, with the overrides again); the others: saved."""
    if args.step == "prepare":
        if args.config_name is None:
            raise ValueError("prepare needs --config-name (and the run's overrides).")
        return launch_config(args.config_name, overrides, args.config_dir)[0]
    if args.run_dir is None or overrides:
        raise ValueError(f"{args.step} reads the run's saved config: give --run-dir RUN_DIR and nothing else "
                         f"(got {' '.join(overrides) or 'no --run-dir'}).")
    return load_run_config(args.run_dir)


def main(argv: list[str] | None = None) -> int:
    args, overrides = _parser().parse_known_args(argv)
    try:
        run = run_config(args, overrides)
        code = {"prepare": lambda: prepare(run, args), "serve": lambda: serve(run),
                "export": lambda: export(run)}[args.step]()
    except REFUSALS as err:
        refuse(f"job_step {args.step}", err)
    return code or 0


if __name__ == "__main__":
    sys.exit(main())

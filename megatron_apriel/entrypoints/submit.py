"""``apriel-submit``: render, check and submit the SLURM training job of a config.

    apriel-submit --config-name apriel_15b model.hf_path=/shared/models/apriel run_dir=/shared/runs/a1 \\
        slurm.partition=gpu slurm.account=myproj [slurm.hetjob=false] [--dry-run]

The config is composed exactly as ``apriel-train`` composes it (same presets and overrides), then
checked before anything is submitted: the trainer ranks against the GPUs per node and TP x PP, the
fleet against whole rollout nodes, the partition (and its node count) and the account against
``sinfo``/``sacctmgr``, and the run directory, the model and the Python against filesystems the
compute nodes share. Each refusal names the key to change. The rendered script is written to
``run_dir/slurm/train.<time>.sbatch`` (``--dry-run`` stops there); then ``sbatch`` submits it and
the job id, the job log and the component logs are printed. With ``launch.gpus_per_node > 0`` the
trainer and the fleet share one node: a one-node plain job with the local launch's GPU split.
"""

from __future__ import annotations

import argparse
import getpass
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from megatron_apriel.refusals import REFUSALS, refuse
from megatron_apriel.run_dir import RunDir
from megatron_apriel.slurm import checks
from megatron_apriel.slurm.render import hetjob


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="apriel-submit", description=__doc__.split("\n")[0],
                                epilog="Everything else on the command line is a Hydra override (key=value).")
    p.add_argument("--config-name", required=True, help="preset, as for apriel-train (e.g. apriel_15b)")
    p.add_argument("--config-dir", default=None, help="a directory of your own presets (Hydra's --config-dir)")
    p.add_argument("--dry-run", action="store_true", help="check and write the script, do not submit")
    p.add_argument("--template", default=None,
                   help="the job script to render (default: the shipped slurm/train.sbatch)")
    return p


def problems(run, layout, query: checks.Query, mounts_text: str, env: dict,
             cluster: bool) -> tuple[list[str], list[str]]:
    """(problems, notes) of every check that needs more than the config."""
    s = run.slurm
    roots = checks.shared_roots(s.shared_roots, env)
    found, notes = [], []
    paths = [("run_dir", run.run_dir), ("slurm.python", s.python or sys.executable)]
    if run.model.hf_path and not run.tiny_base.enabled:  # a tiny base is built inside run_dir
        paths.append(("model.hf_path", run.model.hf_path))
    if s.env_file:
        paths.append(("slurm.env_file", s.env_file))
    found += [m for what, p in paths if (m := checks.path_problem(what, p, roots, mounts_text))]
    if cluster:
        found += checks.partition_problems(s.partition, layout.total_nodes, query)
        found += checks.node_problems(s.partition, layout, hetjob=hetjob(run, layout), cpus_per_task=s.cpus_per_task,
                                      query=query)
        acct, note = checks.account_problems(s.account, env.get("USER") or getpass.getuser(), query)
        found += acct
        notes += ([note] if note else []) + checks.stop_time_notes(run.run_dir, s.signal_s, query)
    else:
        notes.append("partition and account: not checked (--dry-run)")
    return found, notes


def describe(run, layout) -> str:
    """The job's shape in one line (and, on one node, each process's GPUs)."""
    if layout.one_node:
        from megatron_apriel.slurm.layout import one_node_split

        split = one_node_split(run)
        gpus = (f"servers on GPUs {' | '.join(split.servers)}, trainer on {split.trainer}"
                + (f", idle {','.join(split.idle)}" if split.idle else ""))
        return (f"one-node plain job: {layout.train_tasks_per_node} trainer rank(s) and {layout.servers_per_node} vLLM "
                f"server(s) sharing its {run.launch.gpus_per_node} GPUs ({gpus})")
    kind = "heterogeneous job" if hetjob(run, layout) else "plain job"
    return (f"{kind}: {layout.train_nodes} trainer node(s) x {layout.train_tasks_per_node} rank(s), "
            f"{layout.rollout_nodes} rollout node(s) x {layout.servers_per_node} vLLM server(s)")


def write_script(text: str, run_dir: str) -> Path:
    out = RunDir(run_dir).slurm / f"train.{time.strftime('%Y%m%d-%H%M%S')}.sbatch"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out


def submit(script: Path) -> str:
    """``sbatch`` the script; the job id."""
    proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"sbatch {script} failed (exit code {proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout.strip().split(";")[0]


def main(argv: Optional[list[str]] = None) -> int:
    from megatron_apriel.config import compose_run
    from megatron_apriel.slurm.layout import job_layout
    from megatron_apriel.slurm.render import render, shipped

    args, overrides = _parser().parse_known_args(argv)
    try:
        run, _ = compose_run(args.config_name, overrides, args.config_dir)
        layout = job_layout(run)
        template = Path(args.template) if args.template else shipped("train.sbatch")
        text = render(template.read_text(), run, layout, args.config_name, overrides, args.config_dir)
        found, notes = problems(run, layout, checks.run_query, Path("/proc/mounts").read_text(), dict(os.environ),
                                cluster=not args.dry_run)
    except REFUSALS as err:
        refuse("apriel-submit", err)
    if found:
        print("apriel-submit: not submitted:\n" + "\n".join(f"  - {m}" for m in found), file=sys.stderr)
        return 2
    script = write_script(text, run.run_dir)
    print(f"{describe(run, layout)}; " + "; ".join(notes))
    print(f"script: {script}")
    if args.dry_run:
        return 0
    try:
        job = submit(script)
    except RuntimeError as err:
        print(f"apriel-submit: error: {err}", file=sys.stderr)
        return 1
    print(f"submitted job {job}\n  job log: {run.run_dir}/slurm/apriel-{job}.out\n"
          f"  component logs: {run.run_dir}/logs/{{prepare,server_*,actor,trainer,export}}.log")
    return 0


if __name__ == "__main__":
    sys.exit(main())

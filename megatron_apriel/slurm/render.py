"""The training job's script for one config: the shipped ``slurm/train.sbatch`` with its knob block
(between ``# >>> knobs`` and ``# <<< knobs``) replaced by this run's resources (``#SBATCH`` lines)
and variables (pure: no SLURM calls)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional

from megatron_apriel.config import RunConfig
from megatron_apriel.slurm.layout import JobLayout

REPO_SLURM_DIR = Path(__file__).resolve().parents[2] / "slurm"
"""The shipped scripts (``train.sbatch``, ``cluster.env``, ...), next to the package in a checkout."""
BEGIN, END = "# >>> knobs", "# <<< knobs"
DROPPED_OVERRIDES = ("run_dir=",)
"""Set by the script itself (``APRIEL_RUN_DIR``, the job's ports)."""


def shipped(name: str) -> Path:
    path = REPO_SLURM_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: apriel-submit renders the scripts of a source checkout "
                                "(pip install -e .); pass --template to use another copy of slurm/train.sbatch.")
    return path


def _component(run: RunConfig, nodes: int, tasks_per_node: int) -> list[str]:
    """The ``#SBATCH`` options of one component (or of the whole plain job)."""
    s = run.slurm
    opts = [f"--partition={s.partition}" if s.partition else None, f"--account={s.account}" if s.account else None,
            f"--qos={s.qos}" if s.qos else None, f"--time={s.time}", f"--nodes={nodes}",
            f"--ntasks-per-node={tasks_per_node}", f"--gpus-per-node={s.gpus_per_node}" if s.gpus_per_node else None,
            "--exclusive" if s.exclusive else None, *s.sbatch_args]
    return [f"#SBATCH {o}" for o in opts if o]


def hetjob(run: RunConfig, layout: JobLayout) -> bool:
    """Whether the job is heterogeneous: ``slurm.hetjob``, unless one node holds everything."""
    return run.slurm.hetjob and not layout.one_node


def sbatch_lines(run: RunConfig, layout: JobLayout) -> list[str]:
    """Resources: two components (trainer nodes, rollout nodes) or one plain job of both."""
    s = run.slurm
    head = [f"#SBATCH --output={run.paths.slurm / 'apriel-%j.out'}",
            f"#SBATCH --signal=B:USR1@{s.signal_s}"]
    if hetjob(run, layout):
        return head + _component(run, layout.train_nodes, layout.train_tasks_per_node) + ["#SBATCH hetjob"] + \
            _component(run, layout.rollout_nodes, layout.servers_per_node)
    return head + _component(run, layout.total_nodes, max(layout.train_tasks_per_node, layout.servers_per_node))


def variables(run: RunConfig, layout: JobLayout, config_name: str, overrides: list[str],
              config_dir: Optional[str]) -> dict[str, str]:
    s = run.slurm
    kept = [o for o in overrides if not o.startswith(DROPPED_OVERRIDES)]
    return {
        "APRIEL_PYTHON": s.python or sys.executable,
        "APRIEL_CONFIG": config_name,
        "APRIEL_OVERRIDES": shlex.join(kept),
        "APRIEL_CONFIG_DIR": str(Path(config_dir).resolve()) if config_dir else "",
        "APRIEL_RUN_DIR": str(Path(run.run_dir).resolve()),
        "APRIEL_TRAIN_NODES": str(layout.train_nodes),
        "APRIEL_TRAIN_TASKS_PER_NODE": str(layout.train_tasks_per_node),
        "APRIEL_SERVERS_PER_NODE": str(layout.servers_per_node),
        "APRIEL_GPUS_PER_NODE": str(layout.gpus_per_node),
        "APRIEL_ONE_NODE": str(int(layout.one_node)),
        "APRIEL_ENV_FILE": str(Path(s.env_file).resolve()) if s.env_file else str(shipped("cluster.env")),
        "APRIEL_CPUS_PER_TASK": str(s.cpus_per_task),
        "APRIEL_PORT_BASE": str(s.port_base),
        "APRIEL_STOP_GRACE_S": str(s.stop_grace_s),
        "APRIEL_MAX_REQUEUES": str(s.max_requeues),
        "APRIEL_SRUN_ARGS": shlex.join(s.srun_args),
    }


def render(template: str, run: RunConfig, layout: JobLayout, config_name: str, overrides: list[str],
           config_dir: Optional[str] = None) -> str:
    """``template`` with its knob block replaced; every value shell-quoted."""
    start, end = template.find(BEGIN), template.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the template has no knob block ({BEGIN!r} ... {END!r}): is it slurm/train.sbatch?")
    block = [f"{BEGIN} (rendered by apriel-submit --config-name {config_name})", *sbatch_lines(run, layout)]
    block += [f"{k}={shlex.quote(v)}" for k, v in variables(run, layout, config_name, overrides, config_dir).items()]
    return template[:start] + "\n".join(block) + "\n" + template[end:]

"""The end of a run: which step the newest checkpoint holds, and that checkpoint as a Hugging Face
model in ``run_dir/hf`` (``launch.export_hf``; the local launcher and SLURM's ``export`` step)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

from megatron_apriel.config import RunConfig


def checkpointed_step(run: RunConfig) -> Optional[int]:
    from megatron_apriel.trainer.checkpoint import latest_checkpoint

    latest = latest_checkpoint(run.paths.checkpoints)
    return None if latest is None else json.loads((latest / "state.json").read_text())["step"]


def export_hf(run: RunConfig) -> Optional[Path]:
    """The newest checkpoint as a Hugging Face model in run_dir/hf (replaced if it exists)."""
    from megatron_apriel.convert.checkpoint import mcore_to_hf
    from megatron_apriel.trainer.checkpoint import latest_checkpoint

    latest = latest_checkpoint(run.paths.checkpoints)
    if latest is None:
        return None
    out = run.paths.hf
    shutil.rmtree(out, ignore_errors=True)
    mcore_to_hf(latest / "dist", out, hf_reference=run.model.hf_path, progress=False)
    return out

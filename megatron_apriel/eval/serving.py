"""The model under evaluation: which HF directory is served, and the ``apriel-serve`` fleet.

A checkpoint is an HF model directory (``config.json`` + safetensors, e.g. a run's ``hf/``
export), or one of our Megatron distributed checkpoints (``run_dir/checkpoints/step_N`` or its
``dist/``), which is converted once into ``OUT/hf_converted`` (`convert.checkpoint.mcore_to_hf`;
kept, so a resumed evaluation does not convert again; not at all when ``--servers`` serve it).
The conversion takes config, tokenizer and key layout from ``hf_reference``, by default the
run's base model (``model.hf_path`` in ``run_dir/config.yaml``, or ``run_dir/base`` for the
tiny presets).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from megatron_apriel.fleet.registry import ServerProcess, start_server
from megatron_apriel.run_dir import RunDir

CONVERTED = "hf_converted"


def _dist_dir(path: Path) -> Optional[Path]:
    for candidate in (path, path / "dist"):
        if (candidate / "metadata.json").is_file():
            return candidate
    return None


def run_base_model(dist: Path) -> Optional[Path]:
    """The base model of the run a dist checkpoint belongs to (``RUN/checkpoints/step_N/dist``)."""
    for parent in dist.parents:
        run_dir = RunDir(parent)
        config = run_dir.config
        if run_dir.checkpoints.is_dir() and config.is_file():
            from megatron_apriel.config import load_run_config

            run = load_run_config(parent)  # with tiny_base.enabled, model.hf_path is run_dir/base
            if not run.model.hf_path or (run.tiny_base.enabled and not (run_dir.base / "config.json").is_file()):
                return None
            return Path(run.model.hf_path)
    return None


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint to evaluate, checked: an HF directory, or a dist checkpoint and its reference."""

    path: Path
    dist: Optional[Path] = None
    """The directory holding metadata.json (None for an HF directory)."""
    reference: Optional[Path] = None
    """The HF model giving a dist checkpoint its config and tokenizer."""

    @property
    def tokenizer_dir(self) -> Path:
        return self.reference if self.dist is not None else self.path


def inspect_checkpoint(checkpoint: str | Path, hf_reference: Optional[str | Path] = None) -> Checkpoint:
    """What ``checkpoint`` is (see module doc); ValueError saying what to pass when it is neither kind."""
    path = Path(checkpoint)
    if not path.is_dir():
        raise ValueError(f"checkpoint {path}: no such directory; give an HF model directory or a Megatron "
                         "checkpoint (RUN/checkpoints/step_N).")
    if (path / "config.json").is_file():
        return Checkpoint(path)
    dist = _dist_dir(path)
    if dist is None:
        raise ValueError(f"checkpoint {path} is neither an HF model directory (no config.json) nor a Megatron dist "
                         "checkpoint (no metadata.json in it or in its dist/).")
    reference = Path(hf_reference) if hf_reference else run_base_model(dist)
    if reference is None or not (reference / "config.json").is_file():
        raise ValueError(f"checkpoint {dist} is a Megatron dist checkpoint and no HF reference was found for its "
                         "config and tokenizer: pass --hf-reference BASE_MODEL_DIR.")
    return Checkpoint(path, dist, reference)


def served_dir(checkpoint: Checkpoint, out_dir: Path) -> Path:
    """The HF directory to serve: the checkpoint itself, or its conversion into ``OUT/hf_converted``
    (done once; a resumed evaluation finds it)."""
    if checkpoint.dist is None:
        return checkpoint.path
    target = out_dir / CONVERTED
    source = target / "apriel_eval_source.json"
    if target.exists():
        recorded = json.loads(source.read_text()).get("dist") if source.is_file() else None
        if recorded != str(checkpoint.dist.resolve()):
            raise ValueError(f"{target} holds a conversion of {recorded or 'an unknown checkpoint'}, not of "
                             f"{checkpoint.dist}: remove it, or use another --out.")
        return target
    from megatron_apriel.convert.checkpoint import mcore_to_hf

    print(f"[apriel-eval] converting {checkpoint.dist} to {target} (reference {checkpoint.reference})", flush=True)
    mcore_to_hf(checkpoint.dist, target, hf_reference=checkpoint.reference, progress=False)
    source.write_text(json.dumps({"dist": str(checkpoint.dist.resolve()), "hf_reference": str(checkpoint.reference)}))
    return target


def server_env(index: int, gpus_per_server: int) -> dict[str, str]:
    """Environment overrides of server ``index``: with ``gpus_per_server`` k > 0 it sees GPUs
    ``index*k .. index*k + k - 1`` of the node (``CUDA_VISIBLE_DEVICES``); with 0, what this process sees."""
    assert gpus_per_server >= 0, gpus_per_server  # checked with the other options by apriel-eval
    if gpus_per_server == 0:
        return {}
    first = index * gpus_per_server
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in range(first, first + gpus_per_server))}


@contextmanager
def local_fleet(hf_dir: Path, count: int, log_dir: Path, vllm_args: list[str], startup_timeout_s: float,
                gpus_per_server: int = 0) -> Iterator[list[str]]:
    """Start ``count`` ``apriel-serve`` processes of ``hf_dir`` (each on its own GPUs when
    ``gpus_per_server`` > 0, see `server_env`); yields their URLs; stops them all."""
    from megatron_apriel.parallel.rendezvous import free_port

    log_dir.mkdir(parents=True, exist_ok=True)
    servers: list[ServerProcess] = []
    try:
        for i in range(count):
            servers.append(start_server(str(hf_dir), free_port(), log_dir / f"server_{i}.log", extra_args=vllm_args,
                                        env=server_env(i, gpus_per_server)))
        for server in servers:
            try:
                server.wait_healthy(startup_timeout_s)
            except (RuntimeError, TimeoutError) as err:
                raise RuntimeError(f"checkpoint {hf_dir} failed to serve (log: {server.log_path}): {err}") from err
        yield [s.url for s in servers]
    finally:
        for server in servers:
            server.stop()

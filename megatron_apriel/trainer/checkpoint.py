"""Trainer checkpoints: model + optimizer (Megatron distributed checkpoint), scheduler, step,
every rank's RNG states and the rollout source's state, written atomically.

Layout under ``run_dir/checkpoints``::

    step_00000042/
      dist/               Megatron dist checkpoint (torch_dist): model and optimizer shards, plus
                          apriel_model.json (the architecture, for apriel-convert mcore-to-hf)
      rng/rank_<r>.pt     torch / numpy / python / Megatron-tracker RNG states of rank r
      state.json          step, scheduler, layout, rollout-source state, format version
      stop_seconds        what a stop takes, measured (the trainer writes it after the save)
    latest                name of the newest complete checkpoint

A checkpoint is written into ``step_N.tmp`` and renamed only when every rank has finished, so a
crash never leaves anything that looks complete. Model weights are stored under the same keys as
``apriel-convert hf-to-mcore`` writes, so either can initialise a run.

About the CPU "hang" of ``dist_checkpointing.save`` (CPU_NOTES A0), two causes, both checked:
(1) its file writer forks one process per file, and each calls ``psutil`` before its error
handling: without psutil installed the writers die and the parent waits forever (psutil is now a
dependency); (2) it also starts a *spawn* helper process, which re-imports ``__main__``: a launched
script without an ``if __name__ == "__main__":`` guard re-runs its ``init_process_group`` there and
blocks in the rendezvous. Our entry points are guarded; scripts that save checkpoints must be too.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from megatron_apriel.model.arch import ModelArch
from megatron_apriel.parallel.collectives import barrier, world_rank, world_size
from megatron_apriel.parallel.groups import ParallelContext

FORMAT_VERSION = 1
# Optimizer state saved fully in parallel, as each DP rank holds it: it resumes at the same TP/PP
# (any DP). The model weights are saved in model space and load at any layout.
_OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded(chunks, optimizer, loading: bool) -> dict:
    model = chunks[0].module.sharded_state_dict()  # the bare GPTModel's keys, as the converter writes them
    optim = optimizer.sharded_state_dict(model, is_loading=loading, metadata=_OPTIM_METADATA)
    if not loading:
        _zero_padding(optim)
    return {"model": model, "optimizer": optim}


def _zero_padding(node) -> None:
    """Zero the padding Megatron writes between parameters in the optimizer's bucket tensors.

    The ``dp_reshardable`` format covers each bucket whole: the gaps between parameters (a
    parameter starts at a multiple of 64 elements) are ``torch.empty`` tensors, marked
    ``padding``, so a checkpoint held whatever bytes that memory had (seen: 1e26). Nothing reads them
    back, but two saves of the same state then differ; zeroed, a checkpoint is a function of the
    training state alone."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    if isinstance(node, dict):
        flag = node.get("padding")
        if isinstance(flag, LocalNonpersistentObject) and flag.obj is True:
            for item in node.values():
                if isinstance(item, ShardedTensor):
                    item.data.zero_()
        for item in node.values():
            _zero_padding(item)
    elif isinstance(node, list):
        for item in node:
            _zero_padding(item)


def save_checkpoint(root: Path, step: int, *, chunks, optimizer, scheduler, ctx: ParallelContext, extra: dict,
                    arch: ModelArch, keep_last: int = 0) -> Path:
    """Collective: every rank calls it. Returns the complete checkpoint directory."""
    from megatron.core import dist_checkpointing

    from megatron_apriel.convert.checkpoint import write_model_metadata

    tmp, final = step_dir(root, step).with_suffix(".tmp"), step_dir(root, step)
    if world_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save of the same step
        (tmp / "dist").mkdir(parents=True)
        (tmp / "rng").mkdir()
    barrier()
    dist_checkpointing.save(_sharded(chunks, optimizer, loading=False), str(tmp / "dist"))
    torch.save(_rng_state(), tmp / "rng" / f"rank_{world_rank()}.pt")
    barrier()
    if world_rank() == 0:
        state = {"format_version": FORMAT_VERSION, "step": step, "scheduler": scheduler.state_dict(),
                 "world_size": world_size(),
                 "layout": {"tp": ctx.dims.tp, "pp": ctx.dims.pp, "dp": ctx.dims.dp, "cp": ctx.dims.cp},
                 **extra}
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
        # lets `apriel-convert mcore-to-hf --mcore .../dist` export it without an HF reference
        write_model_metadata(tmp / "dist", arch, {"trainer_step": step})
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        (root / "latest.tmp").write_text(final.name)
        (root / "latest.tmp").rename(root / "latest")
        _prune(root, keep_last)
    barrier()
    return final


def _prune(root: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    complete = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in complete[:-keep_last]:
        shutil.rmtree(old)


def latest_checkpoint(root: Path) -> Optional[Path]:
    """The newest complete checkpoint under ``root``, or None."""
    marker = root / "latest"
    if not marker.is_file():
        return None
    path = root / marker.read_text().strip()
    if not (path / "state.json").is_file():
        raise FileNotFoundError(f"{marker} names {path.name}, which is incomplete or missing; delete {marker} "
                                "to start over or restore the checkpoint.")
    return path


@torch.no_grad()
def _materialize_adam_state(optimizer) -> None:
    """Give a fresh torch Adam its state tensors (exp_avg, exp_avg_sq, step) before loading.

    Megatron's distributed optimizer on torch Adam (the path without TE/Apex, i.e. CPU) reads the
    per-parameter ``step`` while building the loading template, and a never-stepped torch Adam has
    none. One step with zero gradients and lr = 0 creates the state without changing a weight
    (the update and the decoupled weight decay both scale with lr); the load then overwrites it.
    """
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_opt = inner.optimizer
        if not isinstance(torch_opt, torch.optim.Adam) or len(torch_opt.state):
            continue
        saved_lr = [g["lr"] for g in torch_opt.param_groups]
        for group in torch_opt.param_groups:
            group["lr"] = 0.0
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        torch_opt.step()
        torch_opt.zero_grad(set_to_none=True)
        for group, lr in zip(torch_opt.param_groups, saved_lr):
            group["lr"] = lr


@torch.no_grad()
def _restore_adam_step(optimizer, loaded: dict) -> None:
    """Set torch Adam's per-parameter ``step`` (its bias correction) to the saved one, in every
    optimizer of the chain (a MoE model has two: dense parameters and experts, each sharded over
    its own data-parallel group).

    On the torch-Adam path the saved step travels in the param groups; Megatron writes it into the
    state, then overwrites the state from the per-bucket tensors, which do not carry it, so the
    template's step survives. Measured: without this a resumed run diverges from step N + 1 on.
    """
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    parts = [loaded] if len(chained) == 1 else [loaded[i] for i in range(len(chained))]
    for inner, part in zip(chained, parts):
        torch_opt = inner.optimizer
        if not isinstance(torch_opt, torch.optim.Adam):
            continue
        steps = {g["step"] for g in part["optimizer"]["param_groups"] if "step" in g}
        assert len(steps) == 1, f"inconsistent saved optimizer steps {steps}"
        step = float(steps.pop())
        for state in torch_opt.state.values():
            state["step"] = torch.tensor(step)


@torch.no_grad()  # in fp32 the optimizer's main params are views of the (grad-requiring) weights
def load_checkpoint(path: Path, *, chunks, optimizer, scheduler, ctx: ParallelContext) -> dict:
    """Collective. Restores model, optimizer, scheduler and (same world size) RNG; returns state.json."""
    from megatron.core import dist_checkpointing

    state = json.loads((path / "state.json").read_text())
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path} has checkpoint format {state.get('format_version')}, "
                         f"this version reads {FORMAT_VERSION}.")
    _materialize_adam_state(optimizer)
    loaded = dist_checkpointing.load(_sharded(chunks, optimizer, loading=True), str(path / "dist"))
    chunks[0].module.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    _restore_adam_step(optimizer, loaded["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    rng_file = path / "rng" / f"rank_{world_rank()}.pt"
    if state["world_size"] == world_size() and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return state


@torch.no_grad()
def load_model_weights(path: str, chunks) -> None:
    """Initialise the model from a Megatron dist checkpoint (converter output or a trainer checkpoint)."""
    from megatron.core import dist_checkpointing

    if not (Path(path) / "metadata.json").is_file():
        raise FileNotFoundError(f"checkpoint.load={path} is not a Megatron distributed checkpoint (no metadata.json); "
                                "create one with `apriel-convert hf-to-mcore`.")
    model = chunks[0].module
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), path))


HF_DIRECT_LOAD_LIMIT_BYTES = 8 * 2**30
"""Above this, every rank reading the whole HF checkpoint costs too much host memory: convert once."""


@torch.no_grad()
def load_hf_weights(hf_path: str, chunks, arch: ModelArch, ctx: ParallelContext) -> None:
    """Initialise this rank's stage from a Hugging Face checkpoint (the served base model).

    Every rank reads the text decoder's tensors (any key layout: plain, LLaVA) and keeps its own
    stage and shard. Meant for small models; a large one is refused with the one-time conversion
    that replaces it (``apriel-convert hf-to-mcore`` then ``checkpoint.load``).
    """
    from megatron_apriel.convert.hf_io import HFReader
    from megatron_apriel.convert.mapping import detect_layout, hf_to_canonical
    from megatron_apriel.model.state import load_full_state_dict

    reader = HFReader(hf_path)
    size = sum((reader.path / f).stat().st_size for f in set(reader.files.values()))
    if size > HF_DIRECT_LOAD_LIMIT_BYTES:
        raise ValueError(f"{hf_path} holds {size / 2**30:.1f} GiB: convert it once with `apriel-convert hf-to-mcore "
                         f"--hf {hf_path} --out CKPT --tp {ctx.dims.tp} --pp {ctx.dims.pp}` and set "
                         "checkpoint.load=CKPT.")
    layout = detect_layout(reader.files.keys(), reader.config)
    plain = {layout.to_plain(k): k for k in reader.files}
    with reader:
        hf = {name: reader.get(key) for name, key in plain.items() if name is not None}
        load_full_state_dict(chunks[0].module, hf_to_canonical(hf, arch), ctx)

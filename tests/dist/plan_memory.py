"""Measure what a real Megatron model + DDP + distributed optimizer allocate on each rank.

Launched by tests/unit/plan/test_plan_memory.py as ``torchrun --nproc_per_node 2 plan_memory.py
SPEC.json OUT.json``. SPEC: {"cases": [{"name", "arch": {...}, "tp", "pp", "ep", "precision"}...]}
(tp > 1 with experts runs sequence-parallel, as Megatron requires).
For every case and rank it writes the bytes of the distinct storages behind the parameters,
behind their ``main_grad``s, and held by the optimizer after one step (state tensors, plus
master copies that are not views of the parameters), read from the tensors themselves.
"""

import json
import sys

import torch
import torch.distributed as dist

from megatron_apriel.model import ModelArch, ModelConfig, build_model
from megatron_apriel.model.config import OptimConfig
from megatron_apriel.model.wrap import build_optimizer, wrap_model
from megatron_apriel.parallel import ParallelConfig, destroy_parallel, init_parallel
from megatron_apriel.records.samples import TrainSample
from megatron_apriel.trainer.batch import packed_microbatches, split_for_data_parallel
from megatron_apriel.trainer.config import LossConfig
from megatron_apriel.trainer.step import train_step


def _storages(tensors) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def _inner_optimizers(optimizer):
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def _samples(vocab: int) -> list[TrainSample]:
    g = torch.Generator().manual_seed(0)
    return [TrainSample(torch.randint(0, vocab, (12,), generator=g).tolist(), 4, [-1.0] * 8, advantage=1.0 - i)
            for i in range(4)]


def measure(case: dict) -> dict:
    arch = ModelArch(**case["arch"])
    ep = case.get("ep", 1)
    ctx = init_parallel(ParallelConfig(tp=case["tp"], pp=case["pp"], ep=ep, sequence_parallel=arch.is_moe and case["tp"] > 1))
    model = build_model(ModelConfig(arch=arch, precision=case["precision"]), ctx)
    chunks = wrap_model(model, ctx)
    optimizer, scheduler = build_optimizer(chunks, OptimConfig(warmup_steps=0), ctx, total_steps=2)
    mine, ids = split_for_data_parallel(_samples(arch.vocab_size), ctx.dims.dp, ctx.dp_rank)
    train_step(chunks, packed_microbatches(mine, ids, 24), optimizer=optimizer, scheduler=scheduler, ctx=ctx,
               cfg=LossConfig(), vocab_size=arch.vocab_size)
    params = list(model.parameters())
    weights = _storages(params)
    grads = _storages(p.main_grad for p in params)
    inner = _inner_optimizers(optimizer)
    state = [t for o in inner for s in o.state.values() for t in s.values() if torch.is_tensor(t)]
    masters = [p for o in inner for g in o.param_groups for p in g["params"]
               if p.untyped_storage().data_ptr() not in weights]
    out = {"rank": ctx.rank, "tp_rank": ctx.tp_rank, "pp_rank": ctx.pp_rank, "dp_rank": ctx.dp_rank,
           "dp": ctx.dims.dp, "expert_dp_rank": ctx.expert_dp_rank,
           "weights": sum(weights.values()), "grads": sum(grads.values()),
           "master": sum(_storages(masters).values()),
           "adam": sum(t.untyped_storage().nbytes() for t in state if t.dim() > 0),
           "step_counters": sum(t.untyped_storage().nbytes() for t in state if t.dim() == 0),
           "param_names": [n for n, _ in model.named_parameters()],
           "param_numels": [p.numel() for p in params]}
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    return out


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    results = {}
    for case in spec["cases"]:
        mine = measure(case)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        results[case["name"]] = gathered
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    destroy_parallel()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

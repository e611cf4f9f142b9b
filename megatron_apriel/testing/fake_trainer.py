"""The trainer's side of the rollout stream, for benchmarks of the actor: it reads groups as fast
as they come and reports its progress as a trainer does, so the actor keeps admitting work."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from megatron_apriel.records.stream import StreamReader, TrainerProgress, write_progress


async def run_until_read(actor, root: Path, groups: int, groups_per_step: int) -> float:
    """Run ``actor`` (writing its stream under ``root``) until ``groups`` groups are read back;
    stops it and returns the wall seconds from its start to the last group read."""
    reader = StreamReader(root)
    write_progress(root, TrainerProgress(step=0, filled=0, cursor=0, version=0))
    stop = asyncio.Event()
    task = asyncio.create_task(actor.run(stop))
    t0 = time.perf_counter()
    while reader.cursor < groups:
        if reader.next_group() is None:
            write_progress(root, TrainerProgress(step=reader.cursor // groups_per_step, filled=0,
                                                 cursor=reader.cursor, version=0))
            await asyncio.sleep(0.001)
    elapsed = time.perf_counter() - t0
    stop.set()
    await task
    return elapsed

"""Generate and score the samples of one benchmark, resumably.

Each (problem, sample index) is one request of n=1 to the fleet with its own vLLM seed
(`sample_seed`), so a sample is the same whether it is drawn in the first run or after a resume,
whichever other requests share its batch. Each finished sample is scored in the verifier pool
and appended to the benchmark's `ResultsFile` at once; samples already there are not redone.

A multi-turn benchmark's sample (``BenchmarkRun.turns`` set) is an episode of its environment,
run as the actor runs a rollout (``actor/turns.py``: token in, token out, each turn a request of
n=1 with the sample's seed), in the episode workers; its score is the episode's.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from megatron_apriel.actor.trajectory import Trajectory
from megatron_apriel.actor.turns import Turns
from megatron_apriel.data.prompts import render_prompt
from megatron_apriel.eval.metrics import truncate_at_budget
from megatron_apriel.eval.results import BudgetVerdicts, ResultsFile, SampleRecord
from megatron_apriel.eval.scoring import score_texts
from megatron_apriel.fleet.client import Completion, FleetClient
from megatron_apriel.fleet.config import SamplingConfig
from megatron_apriel.records.rollouts import Problem

log = logging.getLogger(__name__)


EVAL_SAMPLING = SamplingConfig(max_tokens=32768, temperature=1.0, top_p=0.95)
"""RECIPE.md section 8's recommendation; the paper evaluates at up to 32K output tokens."""


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """The sampling protocol and concurrency of an evaluation."""

    sampling: SamplingConfig = EVAL_SAMPLING
    """Budget, temperature, top_p and stop strings of every sample (its seed comes from ``seed``)."""
    seed: int = 0
    """Base of every sample's seed: same seed, same samples."""
    budgets: tuple[int, ...] = (4096, 8192, 16384, 24576, 32768)
    """Token budgets at which the saved traces are cut and rescored (those above the budget are dropped)."""
    max_in_flight: int = 64
    """Requests sent to the fleet at once."""
    verifier_workers: int = 2

    def __post_init__(self) -> None:
        s = self.sampling
        if s.temperature < 0 or not 0 < s.top_p <= 1:
            raise ValueError(f"temperature must be >= 0 and top_p in (0, 1], got {s.temperature}, {s.top_p}.")
        if s.max_tokens < 1 or self.max_in_flight < 1 or self.verifier_workers < 1:
            raise ValueError("max_tokens, max_in_flight and verifier_workers must be >= 1.")
        if any(b < 1 for b in self.budgets):
            raise ValueError(f"token budgets must be >= 1, got {self.budgets}.")

    def sample_sampling(self, seed: int) -> SamplingConfig:
        """The settings of one sample, seeded with ``seed``."""
        return replace(self.sampling, seed=seed)

    def identity(self) -> dict:
        """What defines the samples: a resumed evaluation must use the same."""
        s = self.sampling
        return {"temperature": s.temperature, "top_p": s.top_p, "max_tokens": s.max_tokens, "stop": list(s.stop),
                "seed": self.seed}

    @property
    def used_budgets(self) -> list[int]:
        top = self.sampling.max_tokens
        return sorted({b for b in self.budgets if b < top} | {top})


def sample_seed(seed: int, problem_id: str, index: int) -> int:
    """A 31-bit vLLM seed for sample ``index`` of ``problem_id`` (stable across runs and machines)."""
    digest = hashlib.sha256(f"{seed}\0{problem_id}\0{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


@dataclass
class BenchmarkRun:
    """The collaborators one benchmark's evaluation needs (built by the entry point)."""

    name: str
    problems: list[Problem]
    samples: int
    results: ResultsFile
    client: FleetClient
    tokenizer: object
    pool: Executor
    cfg: EvalConfig
    on_sample: Callable[[SampleRecord], None] = field(default=lambda record: None)
    """Called after each new sample is written (the progress bar)."""
    turns: Optional[Turns] = None
    """A multi-turn benchmark's turn loop (its episodes' host inside); None: single-turn samples."""
    environment: str = ""
    """The environment of a multi-turn benchmark's episodes."""


async def _score_and_write(run: BenchmarkRun, problem: Problem, prompt: list[int], index: int, seed: int,
                           completion: Completion) -> SampleRecord:
    text = run.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    loop = asyncio.get_running_loop()
    (result,) = await loop.run_in_executor(run.pool, score_texts, problem, [text])
    record = SampleRecord(benchmark=run.name, problem_id=problem.id, sample=index, seed=seed, prompt_tokens=len(prompt),
                          completion_ids=completion.token_ids, finish_reason=completion.finish_reason, text=text,
                          outcome=result.outcome, success=result.success, score=result.score,
                          detail=result.detail[:500])
    return _write(run, record)


async def _one(run: BenchmarkRun, problem: Problem, prompt: list[int], index: int, gate: asyncio.Semaphore,
               writes: list[asyncio.Task]) -> SampleRecord:
    seed = sample_seed(run.cfg.seed, problem.id, index)
    async with gate:
        try:
            if run.turns is not None:
                return _write(run, await _episode(run, problem, index, seed))
            (completion,) = await run.client.generate(prompt, run.cfg.sample_sampling(seed), n=1)
        except ValueError as err:
            raise ValueError(f"benchmark {run.name}, problem {problem.id}: {err} (a prompt plus --max-tokens must fit "
                             "the server's --max-model-len)") from err
    # Shielded: once generated, a sample is scored and written even if the evaluation is stopping.
    write = asyncio.ensure_future(_score_and_write(run, problem, prompt, index, seed, completion))
    writes.append(write)
    return await asyncio.shield(write)


async def _episode(run: BenchmarkRun, problem: Problem, index: int, seed: int) -> SampleRecord:
    """One sample of a multi-turn benchmark: an episode from its first turn to its score."""
    turns, sampling = run.turns, run.cfg.sample_sampling(seed)
    (key,), start = await turns.episodes.open(run.environment, problem, 1)
    try:
        prompt = turns.chat.prompt(start.messages, start.tools)
        (first,) = await run.client.generate(prompt, turns.sampling(sampling, 0), n=1)
        t = Trajectory.single(first, len(prompt))
        text = run.tokenizer.decode(first.token_ids, skip_special_tokens=True)
        (answer,) = await turns.episodes.step([(key, text)])
        result = await turns.rest(key, t, prompt, start, text, answer, sampling)
    except BaseException:
        turns.episodes.discard([key])
        raise
    return SampleRecord(benchmark=run.name, problem_id=problem.id, sample=index, seed=seed, prompt_tokens=len(prompt),
                        completion_ids=t.ids, finish_reason="length" if t.truncated else t.finish_reason,
                        text=run.tokenizer.decode(t.ids, skip_special_tokens=True), turns=max(len(t.turns), 1),
                        outcome=result.outcome, success=result.success, score=result.score,
                        detail=result.detail[:500])


def _write(run: BenchmarkRun, record: SampleRecord) -> SampleRecord:
    run.results.append(record)
    run.on_sample(record)
    return record


async def evaluate_benchmark(run: BenchmarkRun, done: dict[tuple[str, int], SampleRecord]
                             ) -> dict[tuple[str, int], SampleRecord]:
    """Every sample of the benchmark: ``done`` (what ``run.results`` holds already) and the missing
    ones, generated now. On an error (or a cancellation) the generations in flight are cancelled,
    the samples already generated are scored and written, and the error is raised."""
    done = dict(done)
    todo = [(p, i) for p in run.problems for i in range(run.samples) if (p.id, i) not in done]
    if not todo:
        return done
    prompts = {} if run.turns is not None else {  # an episode renders its own start
        p.id: render_prompt(run.tokenizer, p) for p in {p.id: p for p, _ in todo}.values()}
    gate = asyncio.Semaphore(run.cfg.max_in_flight)
    writes: list[asyncio.Task] = []
    tasks = [asyncio.create_task(_one(run, p, prompts.get(p.id, []), i, gate, writes)) for p, i in todo]
    try:
        for record in await asyncio.gather(*tasks):
            done[record.key] = record
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for outcome in await asyncio.gather(*writes, return_exceptions=True):
            if isinstance(outcome, BaseException):  # the error that stops the evaluation is raised above
                log.error("benchmark %s: a generated sample could not be scored or written: %r", run.name, outcome)
    return done


def rescore_at_budgets(records: list[SampleRecord], problems: dict[str, Problem], tokenizer, pool: Executor,
                       budgets: list[int], verdicts: Optional[BudgetVerdicts] = None) -> dict[int, list[bool]]:
    """Per budget, each record's success once its trace is cut at that budget (same order as
    ``records``). Only cut traces are rescored: a trace within the budget keeps its verdict, and
    one ``verdicts`` already holds is not scored again (new verdicts are added to it)."""
    out: dict[int, list[bool]] = {}
    for budget in budgets:
        success = [r.success for r in records]
        cut = []
        for i, r in enumerate(records):
            if r.length > budget:
                known = None if verdicts is None else verdicts.get(r, budget)
                if known is None:
                    cut.append(i)
                else:
                    success[i] = known
        texts = [tokenizer.decode(truncate_at_budget(records[i].completion_ids, records[i].finish_reason, budget)[0],
                                  skip_special_tokens=True) for i in cut]
        futures = [pool.submit(score_texts, problems[records[i].problem_id], [t]) for i, t in zip(cut, texts)]
        for i, future in zip(cut, futures):
            success[i] = future.result()[0].success
            if verdicts is not None:
                verdicts.add(records[i], budget, success[i])
        out[budget] = success
    return out

"""The registry of the five recipe domains' verifiers, and the process pool that runs them.

    result = run_verifier(VERIFIERS[problem.domain], problem, completion)

From an asyncio actor, verify off the event loop in a process pool (math-verify's timers need a
process's main thread, and the code sandbox forks); each worker builds its verifiers from the
run's settings (``actor.verifiers.*``)::

    pool = make_verifier_pool(max_workers=8, settings=run.actor.verifiers)
    result = await verify_async(problem.domain, problem, completion, pool)
"""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
from concurrent.futures import ProcessPoolExecutor
from types import MappingProxyType
from typing import Mapping, Optional

from megatron_apriel.lifetime import die_with_parent
from megatron_apriel.records.rollouts import Problem
from megatron_apriel.verifiers.base import Outcome, Verifier, VerifierResult, extract_final_response, run_verifier
from megatron_apriel.verifiers.code import CodeVerifier
from megatron_apriel.verifiers.config import VerifiersConfig
from megatron_apriel.verifiers.function_calling import FunctionCallingVerifier
from megatron_apriel.verifiers.ifeval import IFEvalVerifier
from megatron_apriel.verifiers.logic import LogicVerifier
from megatron_apriel.verifiers.math import MathVerifier


def build_verifiers(settings: VerifiersConfig) -> Mapping[str, Verifier]:
    """One verifier per domain, with ``settings`` (read-only)."""
    return MappingProxyType({
        "math": MathVerifier(settings.math),
        "code": CodeVerifier(settings.code),
        "logic": LogicVerifier(),
        "ifeval": IFEvalVerifier(),
        "function_calling": FunctionCallingVerifier(),
    })


VERIFIERS: Mapping[str, Verifier] = build_verifiers(VerifiersConfig())
"""Default verifier per domain (read-only; ``build_verifiers`` makes one with other settings)."""

_configured: Optional[Mapping[str, Verifier]] = None
"""In a pool worker: the verifiers built from the pool's settings (``make_verifier_pool``)."""


def verify(domain: str, problem: Problem, completion: str) -> VerifierResult:
    """Score `completion` with this process's verifier of `domain` (the pool's settings in a pool
    worker, else the defaults); verifier crashes become VERIFIER_ERROR."""
    registry = VERIFIERS if _configured is None else _configured
    if domain not in registry:
        raise ValueError(f"unknown domain {domain!r}; registered: {sorted(registry)}.")
    return run_verifier(registry[domain], problem, completion)


def verify_group(domain: str, problem: Problem, completions: list[str]) -> list[VerifierResult]:
    """`verify` for each completion of one group (one call into a process pool per group)."""
    return [verify(domain, problem, c) for c in completions]


def _pool_worker(settings: Optional[VerifiersConfig]) -> None:
    """Initializer of a verifier worker: SIGTERM and SIGINT (sent to the owner's whole process group
    by a launcher, SLURM or Ctrl-C) are the owner's to act on: it shuts the pool down, its in-flight
    verifications finish instead of failing with BrokenProcessPool. The worker dies with its owner.
    Its verifiers are built from ``settings`` (None: the defaults)."""
    global _configured
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)
    if settings is not None:
        _configured = build_verifiers(settings)


def make_verifier_pool(max_workers: int, settings: Optional[VerifiersConfig] = None) -> ProcessPoolExecutor:
    """A process pool whose workers start from a fresh interpreter (spawn: safe from a threaded
    parent), leave stop signals to their owner and die with it, even one killed by SIGKILL
    (PDEATHSIG); the resource tracker then sees EOF and exits. (A forkserver pool outlived a killed
    owner: its workers hold both ends of their task queue and the forkserver's liveness pipe, so
    neither ever sees EOF.) Its workers verify with ``settings`` (None: the defaults)."""
    return ProcessPoolExecutor(max_workers=max_workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_pool_worker, initargs=(settings,))


async def verify_async(domain: str, problem: Problem, completion: str,
                       executor: ProcessPoolExecutor) -> VerifierResult:
    """`verify` in `executor`, awaited without blocking the event loop."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor, verify, domain, problem, completion)


__all__ = ["VERIFIERS", "Outcome", "Verifier", "VerifierResult", "VerifiersConfig", "build_verifiers",
           "extract_final_response", "make_verifier_pool", "run_verifier", "verify", "verify_async", "verify_group"]

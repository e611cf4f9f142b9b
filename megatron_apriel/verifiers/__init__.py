"""Verifiers of the five recipe domains, behind one registry.

    result = run_verifier(VERIFIERS[problem.domain], problem, completion)

From an asyncio actor, verify off the event loop in a process pool (math-verify's timers need a
process's main thread, and the code sandbox forks)::

    pool = make_verifier_pool(max_workers=8)
    result = await verify_async(problem.domain, problem, completion, pool)
"""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
from concurrent.futures import ProcessPoolExecutor
from types import MappingProxyType
from typing import Mapping

from megatron_apriel.lifetime import die_with_parent
from megatron_apriel.rollout.types import Problem
from megatron_apriel.verifiers.base import (Outcome, Verifier, VerifierResult, extract_final_response,
                                            run_verifier)
from megatron_apriel.verifiers.code import CodeVerifier
from megatron_apriel.verifiers.function_calling import FunctionCallingVerifier
from megatron_apriel.verifiers.ifeval import IFEvalVerifier
from megatron_apriel.verifiers.logic import LogicVerifier
from megatron_apriel.verifiers.math import MathVerifier

VERIFIERS: Mapping[str, Verifier] = MappingProxyType({
    "math": MathVerifier(),
    "code": CodeVerifier(),
    "logic": LogicVerifier(),
    "ifeval": IFEvalVerifier(),
    "function_calling": FunctionCallingVerifier(),
})
"""Default verifier per domain (read-only; build your own dict to change settings)."""


def verify(domain: str, problem: Problem, completion: str) -> VerifierResult:
    """Score `completion` with the registry's verifier; verifier crashes become VERIFIER_ERROR."""
    if domain not in VERIFIERS:
        raise ValueError(f"unknown domain {domain!r}; registered: {sorted(VERIFIERS)}.")
    return run_verifier(VERIFIERS[domain], problem, completion)


def verify_group(domain: str, problem: Problem, completions: list[str]) -> list[VerifierResult]:
    """`verify` for each completion of one group (one call into a process pool per group)."""
    return [verify(domain, problem, c) for c in completions]


def _pool_worker() -> None:
    """Initializer of a verifier worker: SIGTERM and SIGINT (sent to the owner's whole process group
    by a launcher, SLURM or Ctrl-C) are the owner's to act on: it shuts the pool down, its in-flight
    verifications finish instead of failing with BrokenProcessPool. The worker dies with its owner."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)


def make_verifier_pool(max_workers: int) -> ProcessPoolExecutor:
    """A process pool whose workers start from a fresh interpreter (spawn: safe from a threaded
    parent), leave stop signals to their owner and die with it, even one killed by SIGKILL
    (PDEATHSIG); the resource tracker then sees EOF and exits. (A forkserver pool outlived a killed
    owner: its workers hold both ends of their task queue and the forkserver's liveness pipe, so
    neither ever sees EOF.)"""
    return ProcessPoolExecutor(max_workers=max_workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_pool_worker)


async def verify_async(domain: str, problem: Problem, completion: str,
                       executor: ProcessPoolExecutor) -> VerifierResult:
    """`verify` in `executor`, awaited without blocking the event loop."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor, verify, domain, problem, completion)


__all__ = ["VERIFIERS", "Outcome", "Verifier", "VerifierResult", "extract_final_response", "make_verifier_pool",
           "run_verifier", "verify", "verify_async", "verify_group"]

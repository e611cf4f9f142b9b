"""Verifiers of the five recipe domains, behind one registry (``registry.py``).

    result = run_verifier(VERIFIERS[problem.domain], problem, completion)

From an asyncio actor, verify off the event loop in a process pool (math-verify's timers need a
process's main thread, and the code sandbox forks); each worker builds its verifiers from the
run's settings (``actor.verifiers.*``, ``config.py``)::

    pool = make_verifier_pool(max_workers=8, settings=run.actor.verifiers)
    result = await verify_async(problem.domain, problem, completion, pool)

The names below load the verifiers (sympy, math-verify, reasoning-gym...) on first use, so that
the settings leaf ``megatron_apriel.verifiers.config`` imports nothing heavy.
"""

__all__ = ["VERIFIERS", "Outcome", "Verifier", "VerifierResult", "VerifiersConfig", "build_verifiers",
           "extract_final_response", "make_verifier_pool", "run_verifier", "verify", "verify_async", "verify_group"]


def __getattr__(name: str):
    if name in __all__:
        from megatron_apriel.verifiers import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'megatron_apriel.verifiers' has no attribute {name!r}")

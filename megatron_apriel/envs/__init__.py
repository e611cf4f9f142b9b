"""Environments: a problem's first messages and tools, a step that answers each model turn (tool
results, the user's next message, or the end), and a score at the end (``base.py``). One per file,
behind one registry (``registry.py``); a single-turn verifier is the one-step case
(``single_turn.py``). See docs/environments.md.

The names below load the environments (and the verifiers) on first use, so that the settings leaf
``megatron_apriel.envs.config`` imports nothing heavy.
"""

__all__ = ["ENVIRONMENTS", "Environment", "Episode", "Reply", "Start", "build_environments", "score_episode"]

_HOMES = {"ENVIRONMENTS": "registry", "build_environments": "registry", "Environment": "base", "Episode": "base",
          "Reply": "base", "Start": "base", "score_episode": "base"}


def __getattr__(name: str):
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f"megatron_apriel.envs.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'megatron_apriel.envs' has no attribute {name!r}")

"""The registry of environments, one per file, listed here by name.

    episode = ENVIRONMENTS["bfcl_multi_turn"].start(problem)

Each domain's verifier is also its one-step environment, under the domain's name (``math``,
``code``, ``logic``, ``ifeval``, ``function_calling``): a single-turn rollout is the case of an
environment that ends after one model turn. To add an environment: write its file (an
``Environment`` with ``start``, an ``Episode`` with ``first``, ``step`` and ``score``; see
``arithmetic.py`` and ``docs/environments.md``), then add one line to ``build_environments``.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping, Optional

from megatron_apriel.envs.arithmetic import ArithmeticEnvironment
from megatron_apriel.envs.base import Environment
from megatron_apriel.envs.bfcl_multi_turn import BfclMultiTurnEnvironment
from megatron_apriel.envs.config import EnvsConfig
from megatron_apriel.envs.self_check import SelfCheckEnvironment
from megatron_apriel.envs.single_turn import SingleTurnEnvironment
from megatron_apriel.verifiers.base import Verifier


def build_environments(settings: Optional[EnvsConfig] = None,
                       verifiers: Optional[Mapping[str, Verifier]] = None) -> Mapping[str, Environment]:
    """Every environment by name (read-only), with ``settings`` (None: the defaults) and the
    single-turn ones wrapping ``verifiers`` (None: ``verifiers.VERIFIERS``)."""
    settings = settings or EnvsConfig()
    if verifiers is None:
        from megatron_apriel.verifiers.registry import VERIFIERS

        verifiers = VERIFIERS
    return MappingProxyType({
        **{domain: SingleTurnEnvironment(verifier) for domain, verifier in verifiers.items()},
        "bfcl_multi_turn": BfclMultiTurnEnvironment(settings.bfcl_multi_turn, settings.calls),
        "arithmetic": ArithmeticEnvironment(settings.arithmetic, settings.calls),
        "self_check": SelfCheckEnvironment(settings.self_check, verifiers),
    })


ENVIRONMENTS: Mapping[str, Environment] = build_environments()
"""Default environment per name (read-only; ``build_environments`` makes one with other settings)."""

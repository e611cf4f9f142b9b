"""Records that flow from the datasets through the actor.

`Problem` is what a dataset row becomes after normalisation: the prompt the policy sees and the
reference its verifier needs. The trainer side adds its rollout types to this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

DOMAINS: tuple[str, ...] = ("math", "code", "logic", "ifeval", "function_calling")
"""The five verifiable-reward domains of the recipe (RECIPE.md section 6)."""

_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Problem:
    """One prompt of one domain, with what its verifier needs to score a completion.

    Attributes:
        id: unique within its dataset file (used for logging, data order and de-duplication).
        domain: one of `DOMAINS`; selects the verifier.
        prompt: chat messages, each `{"role": ..., "content": str}`, in order.
        reference: domain-specific, JSON-serialisable ground truth (see each verifier's docstring).
        metadata: free-form JSON-serialisable extras (source dataset, difficulty, tools, ...).
    """

    id: str
    domain: str
    prompt: list[dict[str, str]]
    reference: Any
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.domain not in DOMAINS:
            raise ValueError(f"Problem {self.id!r}: unknown domain {self.domain!r}; use one of {DOMAINS}.")
        if not self.prompt:
            raise ValueError(f"Problem {self.id!r}: empty prompt; give at least one user message.")
        for message in self.prompt:
            if set(message) != {"role", "content"} or message["role"] not in _ROLES:
                raise ValueError(
                    f"Problem {self.id!r}: bad message {message!r}; each message needs exactly "
                    f"'role' (one of {_ROLES}) and 'content'."
                )
            if not isinstance(message["content"], str):
                raise ValueError(f"Problem {self.id!r}: message content must be a string.")
        try:
            json.dumps(self.reference)
            json.dumps(self.metadata)
        except TypeError as err:
            raise ValueError(f"Problem {self.id!r}: reference and metadata must be JSON-serialisable ({err}).") from err

    def to_json(self) -> dict[str, Any]:
        """The JSON-lines form read back by `from_json` and `megatron_apriel.data`."""
        return {"id": self.id, "domain": self.domain, "prompt": self.prompt,
                "reference": self.reference, "metadata": self.metadata}

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> Problem:
        """Inverse of `to_json`; raises ValueError naming the missing or unknown keys."""
        required = {"id", "domain", "prompt", "reference"}
        missing = required - set(row)
        unknown = set(row) - required - {"metadata"}
        if missing or unknown:
            raise ValueError(f"missing keys {sorted(missing)}, unknown keys {sorted(unknown)}; "
                             f"a Problem row has {sorted(required)} and optionally 'metadata'.")
        return cls(id=str(row["id"]), domain=row["domain"], prompt=list(row["prompt"]),
                   reference=row["reference"], metadata=dict(row.get("metadata") or {}))

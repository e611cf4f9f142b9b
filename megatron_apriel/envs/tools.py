"""One episode's tool instances and the dispatch of parsed calls to their public methods.

    toolbox = Toolbox({"GorillaFileSystem": fs, "MathAPI": math_api}, config.calls)
    results = toolbox.answer_all(parse_calls(text))     # one answer string per call

A function name reaches a method only if it is a public method (no leading underscore) of one of
the instances, as in BFCL's executor (a name on two instances goes to the later one). Everything
else is answered, never raised: ``BadCall``s and unknown names get an error message (BFCL's
wording, ``Error during execution: name 'open' is not defined``), and so does a method that
raises, or one that runs past the time limit (then its state is left as it was before the call:
``isolation.py``). Answers are strings as BFCL writes them (``calls.result_text``).
"""

from __future__ import annotations

import inspect
from typing import Any

from megatron_apriel.envs.calls import ERROR_PREFIX, BadCall, Call, result_text
from megatron_apriel.envs.config import ToolCallConfig
from megatron_apriel.envs.isolation import run_forked


def public_methods(instance: Any) -> list[str]:
    """The names a call may use on ``instance`` (BFCL's rule: bound methods without a leading ``_``)."""
    return [name for name, _ in inspect.getmembers(instance, predicate=inspect.ismethod) if not name.startswith("_")]


class Toolbox:
    """The tool instances of one episode (its own: never shared with another episode)."""

    def __init__(self, instances: dict[str, Any], config: ToolCallConfig, refused: frozenset[str] = frozenset()):
        self.instances = instances
        self.config = config
        self.refused = refused
        """Names answered with BFCL's "is not allowed" (its executor's deny list)."""
        self.owner = {name: key for key, instance in instances.items() for name in public_methods(instance)}

    def answer_all(self, calls: list[Call | BadCall]) -> list[str]:
        return [self.answer(call) for call in calls]

    def answer(self, call: Call | BadCall) -> str:
        if isinstance(call, BadCall):
            return ERROR_PREFIX + call.error
        if call.name in self.refused:
            return f"{ERROR_PREFIX}Function call {call.name} is not allowed."
        key = self.owner.get(call.name)
        if key is None:
            return f"{ERROR_PREFIX}name '{call.name}' is not defined"
        instance = self.instances[key]
        if not self.config.isolate:
            return invoke(instance, call)
        outcome = run_forked(lambda: (invoke(instance, call), instance),
                             timeout_s=self.config.timeout_s, memory_mb=self.config.memory_mb)
        if not outcome.ok:
            return ERROR_PREFIX + outcome.error
        text, self.instances[key] = outcome.value
        return text


def invoke(instance: Any, call: Call) -> str:
    """``instance.<call.name>(*args, **kwargs)`` answered as text; what it raises is answered as
    BFCL's error message (it is the tool's answer to the model, not a failure of ours)."""
    method = getattr(instance, call.name)
    try:
        return result_text(method(*call.args, **call.kwargs))
    except Exception as err:
        return f"{ERROR_PREFIX}{err}"

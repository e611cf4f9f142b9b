"""The judge: any OpenAI-compatible chat endpoint (a vLLM server, ``apriel-serve``, a hosted API).

One request per window: the system message is the versioned prompts (`prompts.py`), the user
message the window verbatim. An answer that `validate.check_answer` refuses is sent back to the
judge with the reason (the conversation goes on: the rejected answer as the assistant's turn,
the reason as the user's), up to ``max_attempts`` requests in all; a timeout or failed request
also uses an attempt. Windows are judged concurrently (at most ``max_in_flight`` requests), each
verdict cached as soon as it is known (`cache.py`), so a kill loses at most the requests in flight.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import httpx

from megatron_apriel.eval.steps.cache import CachedStep, Verdict, VerdictCache
from megatron_apriel.eval.steps.prompts import Prompts
from megatron_apriel.eval.steps.validate import Failure, Rejection, Step, check_answer


@dataclass(frozen=True)
class JudgeConfig:
    url: str
    """The server's base URL (``http://host:8000`` or ``.../v1``); requests go to ``/v1/chat/completions``."""
    model: str
    """The served model name: sent with every request, and part of each verdict's digest."""
    api_key_env: str = "OPENAI_API_KEY"
    """The environment variable holding the API key (sent as a Bearer token when set)."""
    max_in_flight: int = 8
    timeout_s: float = 600.0
    """Seconds one request may take before it counts as a timeout."""
    max_attempts: int = 3
    """Requests per window (the first and the retries after a rejected answer or a failure)."""
    max_tokens: int = 16384
    """The judge's answer budget per request (it repeats the window verbatim, plus labels)."""
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--judge-url {self.url!r}: give an http(s) URL, e.g. http://localhost:8000.")
        if self.max_in_flight < 1 or self.max_attempts < 1 or self.timeout_s <= 0 or self.max_tokens < 1:
            raise ValueError(f"--judge-max-in-flight, --judge-attempts, --judge-timeout and --judge-max-tokens must "
                             f"be positive, got {self.max_in_flight}, {self.max_attempts}, {self.timeout_s}, "
                             f"{self.max_tokens}.")

    @property
    def endpoint(self) -> str:
        base = self.url.rstrip("/")
        return (base if base.endswith("/v1") else base + "/v1") + "/chat/completions"

    def headers(self) -> dict[str, str]:
        key = os.environ.get(self.api_key_env)
        return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass
class Throughput:
    """What this invocation asked of the judge (the report's ``judge.throughput``)."""

    requests: int = 0
    windows_judged: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    failures: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        def per_s(x: int) -> float | None:
            return x / self.wall_s if self.wall_s > 0 else None

        return {"requests": self.requests, "windows_judged": self.windows_judged, "wall_s": self.wall_s,
                "requests_per_s": per_s(self.requests), "completion_tokens": self.completion_tokens,
                "completion_tokens_per_s": per_s(self.completion_tokens), "attempt_failures": self.failures}


async def _ask(client: httpx.AsyncClient, cfg: JudgeConfig, messages: list[dict], tally: Throughput) -> str | Rejection:
    """The content of one chat completion, or the transport failure."""
    tally.requests += 1
    body = {"model": cfg.model, "messages": messages, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature}
    try:
        response = await client.post(cfg.endpoint, json=body, headers=cfg.headers())
    except httpx.TimeoutException as err:
        return Rejection(Failure.TIMEOUT, f"no answer within {cfg.timeout_s}s ({type(err).__name__})")
    except httpx.TransportError as err:
        return Rejection(Failure.JUDGE_ERROR, f"{type(err).__name__} on {cfg.endpoint}: {err}")
    if response.status_code != 200:
        return Rejection(Failure.JUDGE_ERROR, f"HTTP {response.status_code} from {cfg.endpoint}: {response.text[:200]}")
    try:
        data = response.json()
        content = data["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as err:
        return Rejection(Failure.JUDGE_ERROR, f"not a chat completion ({type(err).__name__}: {err}): "
                                              f"{response.text[:200]}")
    tally.completion_tokens += int((data.get("usage") or {}).get("completion_tokens") or 0)
    return content if isinstance(content, str) else Rejection(Failure.JUDGE_ERROR, "the message has no text content")


async def judge_window(client: httpx.AsyncClient, cfg: JudgeConfig, prompts: Prompts, window: str,
                       tally: Throughput) -> tuple[list[Step] | Rejection, int]:
    """(accepted steps or the last rejection, attempts used) for one window."""
    messages = [{"role": "system", "content": prompts.system}, {"role": "user", "content": window}]
    result: list[Step] | Rejection = Rejection(Failure.JUDGE_ERROR, "never asked")
    for attempt in range(1, cfg.max_attempts + 1):
        content = await _ask(client, cfg, messages, tally)
        result = content if isinstance(content, Rejection) else check_answer(content, window)
        if not isinstance(result, Rejection):
            return result, attempt
        tally.failures[result.kind.value] = tally.failures.get(result.kind.value, 0) + 1
        if isinstance(content, str):  # a rejected answer: shown to the judge with the reason
            messages = messages[:2] + [{"role": "assistant", "content": content},
                                       {"role": "user", "content": prompts.retry_message(str(result))}]
    return result, cfg.max_attempts


def to_verdict(digest: str, result: list[Step] | Rejection, attempts: int, cfg: JudgeConfig,
               prompts: Prompts) -> Verdict:
    common = {"digest": digest, "prompts_version": prompts.version, "judge": cfg.model, "attempts": attempts}
    if isinstance(result, Rejection):
        return Verdict(**common, failure=result.kind, detail=result.detail)
    return Verdict(**common, steps=[CachedStep(text=s.text, label=s.label, summary=s.summary) for s in result])


async def judge_all(windows: dict[str, str], *, cfg: JudgeConfig, prompts: Prompts, cache: VerdictCache,
                    on_done: Optional[Callable[[], None]] = None) -> tuple[dict[str, Verdict], Throughput]:
    """A verdict per ``{digest: window}``, each cached when it is not transient; ``on_done``
    after each window (the progress bar)."""
    tally, out = Throughput(), {}
    semaphore = asyncio.Semaphore(cfg.max_in_flight)
    start = time.monotonic()

    async def one(client: httpx.AsyncClient, digest: str, window: str) -> None:
        async with semaphore:
            result, attempts = await judge_window(client, cfg, prompts, window, tally)
            verdict = to_verdict(digest, result, attempts, cfg, prompts)
            if verdict.failure is None or not verdict.failure.transient:
                cache.put(verdict)
            out[digest] = verdict
            tally.windows_judged += 1
        if on_done is not None:
            on_done()

    limits = httpx.Limits(max_connections=cfg.max_in_flight)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s), limits=limits) as client:
        await asyncio.gather(*(one(client, d, w) for d, w in windows.items()))
    tally.wall_s = time.monotonic() - start
    return out, tally

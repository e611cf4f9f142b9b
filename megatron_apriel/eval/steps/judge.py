"""The judge: any OpenAI-compatible chat endpoint (a vLLM server, ``apriel-serve``, a hosted API).

Before any window, one probe (a one-token chat completion): a judge that is not there stops the
command (`JudgeUnavailable`, one line saying what to fix, nothing cached): connection refused,
HTTP 401/403 (the key), 404 (the URL or the model name), any other refusal; a transient error
(HTTP 429, 5xx, a timeout) is retried as below, then stops it too.

One request per window: the system message is the versioned prompts (`prompts.py`), the user
message the window verbatim. An answer that `validate.check_answer` refuses is sent back to the
judge with the reason (the conversation goes on: the rejected answer as the assistant's turn,
the reason as the user's), up to ``max_attempts`` requests in all; a failed request also uses an
attempt, and after a transient one (`TRANSIENT_STATUS`, a timeout, a dropped connection) the
next waits: the server's ``Retry-After`` seconds if it gave them, else ``backoff_s`` doubled at
each such failure, at most ``max_backoff_s``. Windows are judged concurrently (at most
``max_in_flight`` requests), each verdict cached as soon as it is known (`cache.py`), so a kill
loses at most the requests in flight.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional

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
    backoff_s: float = 1.0
    """The wait after a first transient failure (doubled at each next one), unless ``Retry-After`` says."""
    max_backoff_s: float = 120.0
    """The longest wait between two attempts, ``Retry-After`` included."""

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--judge-url {self.url!r}: give an http(s) URL, e.g. http://localhost:8000.")
        if self.max_in_flight < 1 or self.max_attempts < 1 or self.timeout_s <= 0 or self.max_tokens < 1:
            raise ValueError(f"--judge-max-in-flight, --judge-attempts, --judge-timeout and --judge-max-tokens must "
                             f"be positive, got {self.max_in_flight}, {self.max_attempts}, {self.timeout_s}, "
                             f"{self.max_tokens}.")
        if not 0 <= self.backoff_s <= self.max_backoff_s:
            raise ValueError(f"--judge-backoff must be in [0, {self.max_backoff_s}] seconds, got {self.backoff_s}.")

    @property
    def endpoint(self) -> str:
        base = self.url.rstrip("/")
        return (base if base.endswith("/v1") else base + "/v1") + "/chat/completions"

    def headers(self) -> dict[str, str]:
        key = os.environ.get(self.api_key_env)
        return {"Authorization": f"Bearer {key}"} if key else {}


TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
"""HTTP statuses worth another attempt after a wait (the rest are the request's or the setup's fault)."""
Sleep = Callable[[float], Awaitable[None]]


class JudgeUnavailable(RuntimeError):
    """The judge cannot be asked at all: the command stops, with what to fix."""


@dataclass
class Throughput:
    """What this invocation asked of the judge (the report's ``judge.throughput``); the probe is
    not counted."""

    requests: int = 0
    windows_judged: int = 0
    window_chars: int = 0
    """Characters of the windows judged (the trace characters the completion tokens paid for)."""
    completion_tokens: int = 0
    wall_s: float = 0.0
    failures: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        def ratio(x: float, y: float) -> float | None:
            return x / y if y > 0 else None

        return {"requests": self.requests, "windows_judged": self.windows_judged, "wall_s": self.wall_s,
                "requests_per_s": ratio(self.requests, self.wall_s), "completion_tokens": self.completion_tokens,
                "completion_tokens_per_s": ratio(self.completion_tokens, self.wall_s),
                "completion_tokens_per_window": ratio(self.completion_tokens, self.windows_judged),
                "completion_tokens_per_char": ratio(self.completion_tokens, self.window_chars),
                "attempt_failures": self.failures}


@dataclass(frozen=True)
class _Failed:
    """A request that got no answer to check; ``wait`` is set when another attempt may succeed."""

    rejection: Rejection
    wait: Optional[float] = None
    """Seconds the server asked for (``Retry-After``), or 0.0: back off by the schedule."""


def _retry_after(response: httpx.Response) -> float:
    try:
        return max(float(response.headers.get("retry-after", "")), 0.0)
    except ValueError:
        return 0.0


async def _ask(client: httpx.AsyncClient, cfg: JudgeConfig, body: dict) -> httpx.Response | _Failed:
    """The response to one chat completion request, or its transport failure."""
    try:
        return await client.post(cfg.endpoint, json={"model": cfg.model, **body}, headers=cfg.headers())
    except httpx.TimeoutException as err:
        return _Failed(Rejection(Failure.TIMEOUT, f"no answer within {cfg.timeout_s}s ({type(err).__name__})"), 0.0)
    except httpx.TransportError as err:
        wait = None if isinstance(err, httpx.ConnectError) else 0.0
        return _Failed(Rejection(Failure.JUDGE_ERROR, f"{type(err).__name__} on {cfg.endpoint}: {err}"), wait)


def _content(response: httpx.Response, cfg: JudgeConfig, tally: Optional[Throughput]) -> str | _Failed:
    """The message text of a response, or why there is none."""
    if response.status_code != 200:
        wait = _retry_after(response) if response.status_code in TRANSIENT_STATUS else None
        return _Failed(Rejection(Failure.JUDGE_ERROR, f"HTTP {response.status_code} from {cfg.endpoint}: "
                                                      f"{response.text[:200]}"), wait)
    try:
        data = response.json()
        content = data["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as err:
        return _Failed(Rejection(Failure.JUDGE_ERROR, f"not a chat completion ({type(err).__name__}: {err}): "
                                                      f"{response.text[:200]}"))
    if tally is not None:
        tally.completion_tokens += int((data.get("usage") or {}).get("completion_tokens") or 0)
    return content if isinstance(content, str) else _Failed(Rejection(Failure.JUDGE_ERROR, "the message has no text"))


def _wait(cfg: JudgeConfig, failed: _Failed, transient_failures: int) -> float:
    """Seconds before the next attempt after the ``transient_failures``-th transient failure."""
    asked = failed.wait or cfg.backoff_s * 2 ** (transient_failures - 1)
    return min(asked, cfg.max_backoff_s)


def _fatal(cfg: JudgeConfig, response: httpx.Response | _Failed) -> str | None:
    """What to fix, when a probe's outcome means no window can be judged; None when it may be asked."""
    where = f"the judge at {cfg.endpoint}"
    if isinstance(response, _Failed):
        why = response.rejection.detail.replace(" on " + cfg.endpoint, "")
        return None if response.wait is not None else \
            f"cannot reach {where} ({why}): check --judge-url and that the server is up."
    said = response.text[:200].replace("\n", " ")
    if response.status_code in (401, 403):
        return (f"{where} refused the key (HTTP {response.status_code}: {said}): export it in ${cfg.api_key_env} "
                "(--judge-api-key-env names another variable).")
    if response.status_code == 404:
        return (f"HTTP 404 from {cfg.endpoint} ({said}): check --judge-url (the server's base URL, with or without "
                f"/v1) and --judge-model {cfg.model!r} (a name the server serves, as its /v1/models lists).")
    if response.status_code != 200 and response.status_code not in TRANSIENT_STATUS:
        return f"HTTP {response.status_code} from {where} for a one-token request: {said}"
    return None


async def probe(client: httpx.AsyncClient, cfg: JudgeConfig, sleep: Sleep = asyncio.sleep) -> None:
    """One one-token chat completion; `JudgeUnavailable` saying what to fix unless it is answered."""
    body = {"messages": [{"role": "user", "content": "Answer with OK."}], "max_tokens": 1, "temperature": 0.0}
    transient = 0
    for attempt in range(1, cfg.max_attempts + 1):
        response = await _ask(client, cfg, body)
        fatal = _fatal(cfg, response)
        if fatal is not None:
            raise JudgeUnavailable(fatal)
        if isinstance(response, httpx.Response) and response.status_code == 200:
            try:  # the text may be empty (a reasoning model spends its one token thinking): a completion is enough
                response.json()["choices"][0]["message"]
                return
            except (ValueError, KeyError, IndexError, TypeError) as err:
                raise JudgeUnavailable(f"{cfg.endpoint} is not an OpenAI-compatible chat endpoint ({type(err).__name__}"
                                       f" in {response.text[:100]!r}): check --judge-url.") from err
        outcome = response if isinstance(response, _Failed) else _content(response, cfg, None)
        assert isinstance(outcome, _Failed) and outcome.wait is not None, "_fatal let a non-transient failure through"
        transient += 1
        if attempt < cfg.max_attempts:
            await sleep(_wait(cfg, outcome, transient))
    raise JudgeUnavailable(f"the judge at {cfg.endpoint} did not answer a one-token request in {cfg.max_attempts} "
                           f"attempts (last: {outcome.rejection.detail}): is it still starting or overloaded? "
                           "Rerun when it answers, or raise --judge-attempts / --judge-backoff.")


async def judge_window(client: httpx.AsyncClient, cfg: JudgeConfig, prompts: Prompts, window: str,
                       tally: Throughput, sleep: Sleep = asyncio.sleep) -> tuple[list[Step] | Rejection, int]:
    """(accepted steps or the last rejection, attempts used) for one window."""
    messages = [{"role": "system", "content": prompts.system}, {"role": "user", "content": window}]
    result: list[Step] | Rejection = Rejection(Failure.JUDGE_ERROR, "never asked")
    transient = 0
    for attempt in range(1, cfg.max_attempts + 1):
        tally.requests += 1
        response = await _ask(client, cfg, {"messages": messages, "max_tokens": cfg.max_tokens,
                                            "temperature": cfg.temperature})
        content = _content(response, cfg, tally) if isinstance(response, httpx.Response) else response
        result = content.rejection if isinstance(content, _Failed) else check_answer(content, window, prompts.mode)
        if not isinstance(result, Rejection):
            return result, attempt
        tally.failures[result.kind.value] = tally.failures.get(result.kind.value, 0) + 1
        if isinstance(content, str):  # a rejected answer: shown to the judge with the reason
            messages = messages[:2] + [{"role": "assistant", "content": content},
                                       {"role": "user", "content": prompts.retry_message(str(result))}]
        elif content.wait is not None and attempt < cfg.max_attempts:
            transient += 1
            await sleep(_wait(cfg, content, transient))
    return result, cfg.max_attempts


def to_verdict(digest: str, result: list[Step] | Rejection, attempts: int, cfg: JudgeConfig,
               prompts: Prompts) -> Verdict:
    common = {"digest": digest, "prompts_version": prompts.version, "judge": cfg.model, "attempts": attempts}
    if isinstance(result, Rejection):
        return Verdict(**common, failure=result.kind, detail=result.detail)
    return Verdict(**common, steps=[CachedStep(text=s.text, label=s.label, summary=s.summary) for s in result])


async def judge_all(windows: dict[str, str], *, cfg: JudgeConfig, prompts: Prompts, cache: VerdictCache,
                    on_done: Optional[Callable[[], None]] = None,
                    sleep: Sleep = asyncio.sleep) -> tuple[dict[str, Verdict], Throughput]:
    """A verdict per ``{digest: window}``, each cached when it is not transient; ``on_done``
    after each window (the progress bar). `probe` first: `JudgeUnavailable` before any window."""
    tally, out = Throughput(), {}
    semaphore = asyncio.Semaphore(cfg.max_in_flight)
    start = time.monotonic()

    async def one(client: httpx.AsyncClient, digest: str, window: str) -> None:
        async with semaphore:
            result, attempts = await judge_window(client, cfg, prompts, window, tally, sleep)
            verdict = to_verdict(digest, result, attempts, cfg, prompts)
            if verdict.failure is None or not verdict.failure.transient:
                cache.put(verdict)
            out[digest] = verdict
            tally.windows_judged += 1
            tally.window_chars += len(window)
        if on_done is not None:
            on_done()

    limits = httpx.Limits(max_connections=cfg.max_in_flight)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s), limits=limits) as client:
        await probe(client, cfg, sleep)
        await asyncio.gather(*(one(client, d, w) for d, w in windows.items()))
    tally.wall_s = time.monotonic() - start
    return out, tally

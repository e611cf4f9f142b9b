"""A zero-latency stand-in for the vLLM fleet and the tokenizer, at the HTTP seam.

`FakeFleet` answers ``/inference/v1/generate`` and ``/weight_info`` through an
``httpx.MockTransport``, so a real `FleetClient` and a real `Actor` run against it unchanged. Each
completion is the text of an answer to the problem's "What is a + b?" prompt, right with
probability ``accuracy``, encoded one byte per token by `ByteTokenizer`; its log-probs are a fixed
function of the tokens and its version span is the fleet's current ``version``. Used by the
actor's tests and by ``benchmarks/loop.py`` (the actor's own overhead per rollout).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import re
import time
from typing import Optional

import httpx
import numpy as np

from megatron_apriel.verifiers.base import BEGIN_FINAL, END_FINAL

_SUM = re.compile(r"What is (\d+) \+ (\d+)\?")


class ByteTokenizer:
    """Chat template = the last message's bytes; decode = bytes back to text."""

    eos_token_id = 0

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, tokenize=True,
                            return_dict=False) -> list[int]:
        return list(messages[-1]["content"].encode()) or [1]

    def decode(self, ids, skip_special_tokens=True) -> str:
        return bytes(i for i in ids if i).decode(errors="replace")


class FakeFleet:
    def __init__(self, accuracy: float = 0.5, seed: int = 0, max_delay_s: float = 0.0,
                 routed_experts: Optional[tuple[int, int, int]] = None):
        """``max_delay_s``: each generation takes a uniform random time up to this (0: instant).
        ``routed_experts``: (layers, top_k, experts): each choice also carries random routed experts
        in vLLM's format (``apriel-serve --return-routed-experts``)."""
        self.accuracy, self.version, self.max_delay_s = accuracy, 0, max_delay_s
        self.rng = random.Random(seed)
        self.requests = 0
        self.busy_s = 0.0
        """Time spent making answers (a benchmark of the actor subtracts the fleet's own cost)."""
        self.routed_experts = routed_experts
        self._routed_cache: dict[int, str] = {}

    def _answer(self, prompt: str) -> list[int]:
        m = _SUM.search(prompt)
        value = int(m.group(1)) + int(m.group(2)) if m else 0
        if self.rng.random() >= self.accuracy:
            value += self.rng.randint(1, 3)
        return list(f"{BEGIN_FINAL}\\boxed{{{value}}}{END_FINAL}".encode())

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if self.max_delay_s and request.url.path != "/weight_info":
            await asyncio.sleep(self.rng.uniform(0, self.max_delay_s))
        if request.url.path == "/weight_info":
            return httpx.Response(200, json={"weight_version": str(self.version)})
        start = time.perf_counter()
        body = json.loads(request.content)
        self.requests += 1
        prompt = bytes(body["token_ids"]).decode(errors="replace")
        label = str(self.version)
        choices = []
        for i in range(body["sampling_params"]["n"]):
            tokens = self._answer(prompt)
            choice = {"index": i, "finish_reason": "stop", "token_ids": tokens,
                      "weight_versions": [{"version": label, "start": 0, "end": len(tokens)}],
                      "logprobs": {"content": [{"token_id": t, "logprob": -0.01 * (t % 7)} for t in tokens]}}
            if self.routed_experts is not None:
                choice["routed_experts"] = self._routed(len(body["token_ids"]) + len(tokens) - 1)
            choices.append(choice)
        response = httpx.Response(200, json={"choices": choices})
        self.busy_s += time.perf_counter() - start
        return response

    def _routed(self, rows: int) -> str:
        """Expert ids ``[rows, layers, k]`` as vLLM returns them (base64 ``.npy``, uint8): distinct
        random experts per row, made once per length (the fleet's cost is not the actor's)."""
        if rows not in self._routed_cache:
            layers, k, experts = self.routed_experts
            rng = np.random.default_rng(rows)
            ids = np.argsort(rng.random((rows, layers, experts)), axis=-1)[..., :k].astype(np.uint8)
            buf = io.BytesIO()
            np.save(buf, ids, allow_pickle=False)
            self._routed_cache[rows] = base64.b64encode(buf.getvalue()).decode("ascii")
        return self._routed_cache[rows]

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)


_SUM3 = re.compile(r"What is (\d+) \+ (\d+) \+ (\d+)\?")
TOOL_RESULT = re.compile(r"<\|tool\|>(.*?)<\|eos\|>")
"""A tool result in the tiny chat template's text."""


def calculator_policy(context: str) -> str:
    """``FakeToolFleet``'s model for "What is a + b + c?" in the calculator environment: two calls
    over two turns (``add(a, b)``, then ``add(result, c)``), then the answer; three model turns."""
    a, b, c = map(int, _SUM3.search(context).groups())
    results = TOOL_RESULT.findall(context)
    if not results:
        return f"[add(a={a}, b={b})]"
    if len(results) == 1:
        return f"[add(a={results[0]}, b={c})]"
    return f"The sum is \\boxed{{{results[1]}}}."


class FakeToolFleet:
    """A fake fleet for multi-turn rollouts, with a real tokenizer: ``policy(context)`` writes the
    next assistant turn from the decoded context (special tokens kept), and the turn's ids are
    that text encoded in random pieces (each cut with probability ``split_p``): as a sampler does,
    it often produces ids that are not the tokenizer's own encoding of the text, then the EOS
    token, cut at ``max_tokens`` (``finish_reason`` length). Log-probs are a function of the
    tokens; the weight version is ``version``, raised by one every ``bump_every`` requests (0:
    never), so trajectories span versions. ``routed_experts`` (layers, k): each choice carries
    ``[prompt + completion - 1, layers, k]`` uint8 ids, a function of the position (``route``)."""

    def __init__(self, tokenizer, policy, split_p: float = 0.3, seed: int = 0, bump_every: int = 0,
                 routed_experts: Optional[tuple[int, int]] = None, max_delay_s: float = 0.0, slots: int = 0,
                 generation_s: float = 0.0):
        """``slots`` > 0: a server of that many concurrent generations, each taking ``generation_s``
        (a finite capacity that a benchmark can keep busy, or leave idle)."""
        self.tokenizer, self.policy, self.split_p = tokenizer, policy, split_p
        self.rng = random.Random(seed)
        self.version, self.bump_every, self.requests = 0, bump_every, 0
        self.routed_experts, self.max_delay_s = routed_experts, max_delay_s
        self.slots = asyncio.Semaphore(slots) if slots else None
        self.generation_s = generation_s
        self.busy_s = 0.0
        """Time spent making answers, waits excluded (a benchmark of the actor subtracts it)."""
        self.tokens = 0
        """Tokens generated so far."""
        self.sampled: dict[tuple[int, ...], list[list[int]]] = {}
        """Each request's prompt ids -> the ids of its choices."""

    def sample_ids(self, text: str) -> list[int]:
        ids, piece = [], ""
        for ch in text:
            piece += ch
            if self.rng.random() < self.split_p:
                ids += self.tokenizer.encode(piece, add_special_tokens=False)
                piece = ""
        if piece:
            ids += self.tokenizer.encode(piece, add_special_tokens=False)
        return ids + [self.tokenizer.eos_token_id]

    @staticmethod
    def route(position: int, layers: int, k: int) -> np.ndarray:
        return (np.arange(layers * k).reshape(layers, k) + position) % 251

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/weight_info":
            return httpx.Response(200, json={"weight_version": str(self.version)})
        if self.max_delay_s:
            await asyncio.sleep(self.rng.uniform(0, self.max_delay_s))
        if self.slots is not None:
            async with self.slots:
                await asyncio.sleep(self.generation_s)
        start = time.perf_counter()
        body = json.loads(request.content)
        prompt, params = body["token_ids"], body["sampling_params"]
        self.requests += 1
        if self.bump_every and self.requests % self.bump_every == 0:
            self.version += 1
        context = self.tokenizer.decode(prompt, skip_special_tokens=False)
        choices = []
        for i in range(params["n"]):
            tokens = self.sample_ids(self.policy(context))
            finish = "stop"
            if len(tokens) > params["max_tokens"]:
                tokens, finish = tokens[:params["max_tokens"]], "length"
            choice = {"index": i, "finish_reason": finish, "token_ids": tokens,
                      "weight_versions": [{"version": str(self.version), "start": 0, "end": len(tokens)}],
                      "logprobs": {"content": [{"token_id": t, "logprob": -0.01 * (t % 7)} for t in tokens]}}
            if self.routed_experts is not None:
                layers, k = self.routed_experts
                rows = np.stack([self.route(p, layers, k) for p in range(len(prompt) + len(tokens) - 1)])
                buf = io.BytesIO()
                np.save(buf, rows.astype(np.uint8), allow_pickle=False)
                choice["routed_experts"] = base64.b64encode(buf.getvalue()).decode("ascii")
            choices.append(choice)
            self.sampled.setdefault(tuple(prompt), []).append(tokens)
            self.tokens += len(tokens)
        response = httpx.Response(200, json={"choices": choices})
        self.busy_s += time.perf_counter() - start
        return response

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

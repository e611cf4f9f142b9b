"""A fake step judge: an OpenAI-compatible chat server (in a thread) whose answers the test picks.

The judge segments a trace as the offline segmenter does and labels each step by keywords
(`keyword_label`). It answers in the mode its system prompt asks for (boundaries when the prompt
shows a ``"start"`` key: each step's first `START_WORDS` words; copy otherwise: each step's full
text), in a fenced json block; what it gets wrong depends on a marker in the trace, so one run can
hold every case (`CASES`): ``[case:correct]`` (the default), ``[case:malformed]`` (not JSON),
``[case:drop]`` (the last step loses its last character), ``[case:change]`` (the first character
changed), ``[case:label]`` (an unknown label), ``[case:flaky]`` (malformed on the first attempt,
right on the retry), ``[case:slow]`` (waits until `FakeJudge.stop`: a client timeout),
``[case:strip]`` (each step's text stripped of the whitespace around it, bare JSON, as chat models
often answer), ``[case:preamble]`` (a sentence, then the fenced block, then another),
``[case:digit]`` (the first digit in the answer's steps changed), ``[case:ambiguous]`` (each start
one word long). ``block_after=N`` answers the first N requests and holds every later one (a run to
kill). Every request is recorded (`requests`: the trace window and its attempt number; `retries`:
the retry message of each later attempt; `probes`: the one-message requests, answered ``OK``).

As a server it also refuses: HTTP 404 for another path than ``/v1/chat/completions`` or a model
not its own, 401 without ``Authorization: Bearer <api_key>`` when ``api_key`` is set, and 429 with
``Retry-After: <retry_after>`` for the first ``throttle`` window requests (recorded in `requests`
too, and counted in `throttled`).
"""

from __future__ import annotations

import http.server
import json
import re
import threading

from megatron_apriel.eval.steps.offline import segment
from megatron_apriel.parallel.rendezvous import free_port
from megatron_apriel.verifiers.base import BEGIN_FINAL

CASES = ("correct", "malformed", "drop", "change", "label", "flaky", "slow", "strip", "preamble", "digit", "ambiguous")
START_WORDS = 6
_CASE = re.compile(r"\[case:(\w+)\]")
_KEYWORDS = (("final_answer", (BEGIN_FINAL,)), ("backtracking", ("Wait", "wrong", "instead")),
             ("verification", ("check", "Check", "verify")), ("subgoal_setting", ("First,", "Next,", "need to find")),
             ("backward_chaining", ("work backwards", "would require")),
             ("problem_setup", ("asks", "We are given")), ("other", ("Again", "As I said", "repeat")))


def keyword_label(step: str) -> str:
    """The first label whose keywords appear in ``step``; ``forward_reasoning`` when none does."""
    return next((label for label, words in _KEYWORDS if any(w in step for w in words)), "forward_reasoning")


def correct_answer(window: str, mode: str = "copy", start_words: int = START_WORDS) -> dict:
    if mode == "copy":
        return {"steps": [{"text": s, "summary": s[:20], "label": keyword_label(s)} for s in segment(window)]}
    return {"steps": [{"start": " ".join(s.split()[:start_words]), "label": keyword_label(s)} for s in segment(window)]}


def _change_first_digit(steps: list[dict], key: str) -> None:
    for step in steps:
        digit = re.search(r"\d", step[key])
        if digit:
            at = digit.start()
            step[key] = step[key][:at] + str((int(step[key][at]) + 1) % 10) + step[key][at + 1:]
            return


def answer(window: str, attempt: int, mode: str = "copy") -> str:
    """The fake judge's answer to ``window`` at ``attempt`` (1 = first) in ``mode``, by the window's case."""
    found = _CASE.search(window)
    case = found.group(1) if found else "correct"
    good = correct_answer(window, mode, 1 if case == "ambiguous" else START_WORDS)
    key = "text" if mode == "copy" else "start"
    if case == "malformed" or (case == "flaky" and attempt == 1):
        return '{"steps": [{"text": "unterminated'
    if case == "drop":
        good["steps"][-1][key] = good["steps"][-1][key][:-1]
    elif case == "change":
        first = good["steps"][0][key]
        good["steps"][0][key] = ("X" if first[0] != "X" else "Y") + first[1:]
    elif case == "label":
        good["steps"][0]["label"] = "planning"
    elif case == "digit":
        _change_first_digit(good["steps"], key)
    elif case == "strip":
        for step in good["steps"]:
            step[key] = step[key].strip()
        return json.dumps(good)
    fenced = "```json\n" + json.dumps(good, indent=1) + "\n```"
    if case == "preamble":
        return f"Here is the segmentation:\n\n{fenced}\n\nEach step has its dominant label."
    return fenced


class FakeJudge:
    """``with FakeJudge() as judge: ... judge.url``; see the module docstring."""

    def __init__(self, block_after: int | None = None, model: str = "fake-judge", api_key: str | None = None,
                 throttle: int = 0, retry_after: float = 1.0) -> None:
        self.model, self.block_after, self.api_key = model, block_after, api_key
        self.throttle, self.retry_after = throttle, retry_after
        self.requests: list[tuple[str, int]] = []
        self.retries: list[str] = []
        self.probes = 0
        self.throttled = 0
        self.release = threading.Event()
        """Set by `stop`: the held requests (slow, blocked) may go."""
        self.held = threading.Event()
        """Set when a request is first held (slow or blocked)."""
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _refusal(self, path: str, headers, body: dict) -> tuple[int, dict, dict] | None:
        """(status, headers, error body) of a request this server refuses, or None."""
        if path != "/v1/chat/completions" or body.get("model") != self.model:
            return 404, {}, {"error": {"message": f"The model `{body.get('model')}` or path {path} does not exist."}}
        if self.api_key is not None and headers.get("Authorization") != f"Bearer {self.api_key}":
            return 401, {}, {"error": {"message": "Incorrect API key provided."}}
        if len(body["messages"]) > 1:
            with self._lock:
                if self.throttle > 0:
                    self.throttle -= 1
                    self.requests.append((body["messages"][1]["content"], (len(body["messages"]) - 2) // 2 + 1))
                    self.throttled += 1
                    return 429, {"Retry-After": str(self.retry_after)}, {"error": {"message": "Rate limit reached."}}
        return None

    def _reply(self, body: dict) -> str | None:
        """The content to answer with, or None to hold the request until `stop`."""
        if len(body["messages"]) == 1:
            with self._lock:
                self.probes += 1
            return "OK"
        window = body["messages"][1]["content"]
        attempt = (len(body["messages"]) - 2) // 2 + 1
        with self._lock:
            self.requests.append((window, attempt))
            if attempt > 1:
                self.retries.append(body["messages"][-1]["content"])
            blocked = self.block_after is not None and len(self.requests) > self.block_after
        if blocked or "[case:slow]" in window:
            self.held.set()
            self.release.wait()
            return None
        return answer(window, attempt, "boundaries" if '"start"' in body["messages"][0]["content"] else "copy")

    def _handler(self):
        judge = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (the http.server API)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                refused = judge._refusal(self.path, self.headers, body)
                if refused is not None:
                    return self._send(*refused)
                content = judge._reply(body)
                if content is None:
                    return
                self._send(200, {}, {"model": judge.model, "usage": {"completion_tokens": len(content) // 4},
                                     "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]})

            def _send(self, status: int, headers: dict, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                for key, value in {"Content-Type": "application/json", **headers}.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        return Handler

    def start(self) -> "FakeJudge":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "FakeJudge":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

"""A fake step judge: an OpenAI-compatible chat server (in a thread) whose answers the test picks.

The judge segments a trace as the offline segmenter does and labels each step by keywords
(`keyword_label`); what it answers depends on a marker in the trace, so one run can hold every
case (`CASES`): ``[case:correct]`` (the default), ``[case:malformed]`` (not JSON),
``[case:drop]`` (the steps lose the trace's last character), ``[case:change]`` (one character
changed), ``[case:label]`` (an unknown label), ``[case:flaky]`` (malformed on the first attempt,
right on the retry), ``[case:slow]`` (waits until `FakeJudge.stop`: a client timeout).
``block_after=N`` answers the first N requests and holds every later one (a run to kill).
Every request is recorded (`requests`: the trace window and its attempt number).
"""

from __future__ import annotations

import http.server
import json
import re
import threading

from megatron_apriel.eval.steps.offline import segment
from megatron_apriel.parallel.rendezvous import free_port
from megatron_apriel.verifiers.base import BEGIN_FINAL

CASES = ("correct", "malformed", "drop", "change", "label", "flaky", "slow")
_CASE = re.compile(r"\[case:(\w+)\]")
_KEYWORDS = (("final_answer", (BEGIN_FINAL,)), ("backtracking", ("Wait", "wrong", "instead")),
             ("verification", ("check", "Check", "verify")), ("subgoal_setting", ("First,", "Next,", "need to find")),
             ("backward_chaining", ("work backwards", "would require")),
             ("problem_setup", ("asks", "We are given")), ("other", ("Again", "As I said", "repeat")))


def keyword_label(step: str) -> str:
    """The first label whose keywords appear in ``step``; ``forward_reasoning`` when none does."""
    return next((label for label, words in _KEYWORDS if any(w in step for w in words)), "forward_reasoning")


def correct_answer(window: str) -> dict:
    return {"steps": [{"text": s, "summary": s[:20], "label": keyword_label(s)} for s in segment(window)]}


def answer(window: str, attempt: int) -> str:
    """The fake judge's answer to ``window`` at ``attempt`` (1 = first), by the window's case."""
    found = _CASE.search(window)
    case = found.group(1) if found else "correct"
    good = correct_answer(window)
    if case == "malformed" or (case == "flaky" and attempt == 1):
        return '{"steps": [{"text": "unterminated'
    if case == "drop":
        good["steps"][-1]["text"] = good["steps"][-1]["text"][:-1]
    elif case == "change":
        first = good["steps"][0]["text"]
        good["steps"][0]["text"] = ("X" if first[0] != "X" else "Y") + first[1:]
    elif case == "label":
        good["steps"][0]["label"] = "planning"
    return "```json\n" + json.dumps(good) + "\n```"


class FakeJudge:
    """``with FakeJudge() as judge: ... judge.url``; see the module docstring."""

    def __init__(self, block_after: int | None = None, model: str = "fake-judge") -> None:
        self.model, self.block_after = model, block_after
        self.requests: list[tuple[str, int]] = []
        self.release = threading.Event()
        """Set by `stop`: the held requests (slow, blocked) may go."""
        self.held = threading.Event()
        """Set when a request is first held (slow or blocked)."""
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _reply(self, body: dict) -> str | None:
        """The content to answer with, or None to hold the request until `stop`."""
        window = body["messages"][1]["content"]
        attempt = (len(body["messages"]) - 2) // 2 + 1
        with self._lock:
            self.requests.append((window, attempt))
            blocked = self.block_after is not None and len(self.requests) > self.block_after
        if blocked or "[case:slow]" in window:
            self.held.set()
            self.release.wait()
            return None
        return answer(window, attempt)

    def _handler(self):
        judge = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (the http.server API)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                content = judge._reply(body)
                if content is None:
                    return
                data = json.dumps({"model": judge.model, "usage": {"completion_tokens": len(content) // 4},
                                   "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data.encode())

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

"""Remote code runner for a SandboxFusion server (`POST /run_code`), same interface as the local one.

Request: {"code", "language": "python", "stdin", "run_timeout", "compile_timeout", "memory_limit_MB"};
response: {"status": "Success" | "Failed" | "SandboxError", "run_result": {"status": "Finished" |
"TimeLimitExceeded" | ..., "return_code", "stdout", "stderr", "execution_time"}}. A "SandboxError"
or an HTTP failure raises: it is the verifier's failure, never the model's.
"""

from __future__ import annotations

import httpx

from megatron_apriel.verifiers.config import SandboxFusionConfig
from megatron_apriel.verifiers.sandbox import RunResult


class SandboxFusionRunner:
    """`run(code, stdin) -> RunResult` over HTTP; one connection pool per runner."""

    def __init__(self, config: SandboxFusionConfig = SandboxFusionConfig()) -> None:
        self.config = config
        self._client = httpx.Client(base_url=config.url, timeout=config.http_timeout_s)

    def run(self, code: str, stdin: str = "") -> RunResult:
        payload = {"code": code, "language": "python", "stdin": stdin, "compile_timeout": 10,
                   "run_timeout": self.config.run_timeout_s, "memory_limit_MB": self.config.memory_mb}
        response = self._client.post("/run_code", json=payload)
        response.raise_for_status()
        body = response.json()
        if body.get("status") == "SandboxError":
            raise RuntimeError(f"SandboxFusion error: {body.get('message', body)}")
        run = body.get("run_result") or {}
        timed_out = run.get("status") == "TimeLimitExceeded"
        return RunResult(returncode=None if timed_out else run.get("return_code"),
                         stdout=run.get("stdout") or "", stderr=run.get("stderr") or "",
                         timed_out=timed_out, wall_s=float(run.get("execution_time") or 0.0))

    def close(self) -> None:
        self._client.close()

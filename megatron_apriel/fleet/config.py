"""Settings of the vLLM fleet (``fleet.*``: its servers, their flags, requests and watchdogs) and of
one generation request (``SamplingConfig``). A leaf: standard library only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_apriel.choices import BeforeTrip, KvOnUpdate, check_choice


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    """Stop strings (the server detokenises to find them; token ids still hold every token)."""
    ignore_eos: bool = False
    seed: Optional[int] = None

    def to_vllm(self, n: int) -> dict:
        params = {"n": n, "max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "logprobs": 0, "ignore_eos": self.ignore_eos, "stop_token_ids": list(self.stop_token_ids)}
        if self.stop:
            params["stop"] = list(self.stop)
        if self.seed is not None:
            params["seed"] = self.seed
        return params


@dataclass(frozen=True)
class ServerArgs:
    """``vllm serve`` flags, parsed in one place: what the launchers, the planner and ``apriel-serve``
    read from ``fleet.vllm_args`` (``--flag value`` and ``--flag=value`` alike)."""

    argv: tuple[str, ...] = ()

    def value(self, *flags: str) -> Optional[str]:
        """The value of the first of ``flags`` given (a flag's spellings, e.g. --tensor-parallel-size, -tp)."""
        for i, a in enumerate(self.argv):
            for flag in flags:
                if a == flag and i + 1 < len(self.argv):
                    return self.argv[i + 1]
                if a.startswith(flag + "="):
                    return a.split("=", 1)[1]
        return None

    def without(self, *flags: str) -> ServerArgs:
        """These flags less ``flags`` (each spelling, with its value)."""
        out, skip = [], False
        for a in self.argv:
            if skip:
                skip = False
            elif a in flags:
                skip = True
            elif not any(a.startswith(f + "=") for f in flags):
                out.append(a)
        return ServerArgs(tuple(out))

    def given(self, flag: str) -> bool:
        return any(a == flag or a.startswith(flag + "=") for a in self.argv)

    def with_default(self, flag: str, value: Optional[str] = None) -> ServerArgs:
        """These flags plus ``flag`` (with ``value``; a switch without) unless it is given already."""
        if self.given(flag):
            return self
        return ServerArgs(self.argv + ((flag,) if value is None else (flag, value)))

    @property
    def max_model_len(self) -> Optional[int]:
        v = self.value("--max-model-len")
        return None if v is None else int(v)

    @property
    def tensor_parallel_size(self) -> int:
        return int(self.value("--tensor-parallel-size", "-tp") or 1)

    @property
    def pipeline_parallel_size(self) -> int:
        return int(self.value("--pipeline-parallel-size", "-pp") or 1)

    @property
    def data_parallel_size(self) -> int:
        return int(self.value("--data-parallel-size", "-dp") or 1)

    @property
    def gpus(self) -> int:
        """GPUs one server takes (tensor x pipeline x data parallel: a DP > 1 server, as a large MoE
        is served, runs one engine per DP rank, each on its own TP x PP GPUs)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    @property
    def gpu_memory_utilization(self) -> float:
        return float(self.value("--gpu-memory-utilization") or 0.9)  # vLLM's default

    @property
    def host(self) -> str:
        return self.value("--host") or "0.0.0.0"

    @property
    def port(self) -> int:
        return int(self.value("--port") or 8000)


@dataclass(kw_only=True)
class DriftGateConfig:
    """Takes a server whose numeric drift (or MoE routing mismatch) is too large out of the fleet
    (docs/mismatch.md "The drift gate")."""

    enabled: bool = False
    max_drift: float = 0.1
    """Mean |log pi_train - log pi_vllm| over a server's fresh tokens (nats per token) above which it
    trips. Published bf16 drift is 0.03-0.04 (RECIPE.md section 10); fp32 on a CPU is ~2e-7."""
    window_tokens: int = 4096
    """Fresh tokens of a server that are judged together (a window ends at the first step that fills it)."""
    max_routing_mismatch: Optional[float] = None
    """Mixture of experts: the share of a server's compared (fresh token, MoE layer) pairs whose
    expert set differs from the trainer's own, over the same window, above which it trips too
    (``mismatch/server/<host:port>/routing_mismatch``). Null: routing is not judged. fp32 on a CPU
    gives 0; near-tied router scores flip under bf16, so measure a healthy run's figure first."""
    before_trip: str = "train"
    """Its tokens in the stream from before the trip: train (with loss.correction, whatever it is) or
    drop. Counted either way (rollout/groups_from_tripped)."""

    def __post_init__(self) -> None:
        if self.max_drift <= 0 or self.window_tokens < 1:
            raise ValueError(f"fleet.drift_gate.max_drift must be > 0 and window_tokens >= 1, got "
                             f"{self.max_drift}, {self.window_tokens}.")
        if self.max_routing_mismatch is not None and not 0 <= self.max_routing_mismatch < 1:
            raise ValueError(f"fleet.drift_gate.max_routing_mismatch={self.max_routing_mismatch}: a share in [0, 1), "
                             "or null not to judge routing.")
        check_choice("fleet.drift_gate.before_trip", self.before_trip, BeforeTrip)


@dataclass(kw_only=True)
class FleetConfig:
    """The vLLM servers that generate rollouts (``apriel-serve``, one per node or GPU group)."""

    servers: list[str] = field(default_factory=list)
    """Base URLs of servers that are already running. Empty: discover them in run_dir/fleet/
    (the launcher, or SLURM, starts them with ``--register-dir``)."""
    num_servers: int = 1
    """Servers the local launcher starts, and how many the trainer and the actor wait for."""
    host: str = "127.0.0.1"
    """Where the local launcher's servers listen."""
    port: int = 0
    """First port of the local servers (server i uses port + i); 0: free ports."""
    vllm_args: list[str] = field(default_factory=list)
    """Extra ``vllm serve`` flags, e.g. [--max-model-len, "20480", --tensor-parallel-size, "1"]
    (read through ``ServerArgs``)."""
    per_server_vllm_args: list[list[Any]] = field(default_factory=list)
    """Flags for single servers that the run starts, after ``vllm_args``: entry i goes to server i, []
    leaves one as it is. A mixed fleet, e.g. one server in FP8 beside bf16 ones, whose drift the
    trainer then reports per server (docs/mismatch.md)."""
    startup_timeout_s: float = 900.0
    """How long a server may take to answer /health (vLLM loads and compiles the model first)."""
    max_restarts: int = 3
    """Restarts of a crashed server by the local launcher before the run fails."""
    request_attempts: int = 8
    """Tries of one generation request (a failed server's requests go to another one)."""
    cooldown_s: float = 2.0
    """A server that failed gets no request for this long."""
    request_timeout_s: float = 3600.0
    stall_timeout_s: Optional[float] = 300.0
    """A server with requests in flight that produces no token for this long (its /metrics counter)
    is treated as failed and its requests go elsewhere; null: never (weight updates pause it briefly)."""
    drift_gate: DriftGateConfig = field(default_factory=DriftGateConfig)
    kv_on_update: str = "recompute"
    """What a weight update does to the requests in flight and their KV cache (docs/serving.md):
    recompute (vLLM's /pause default: every running request's prefix is computed again with the new
    weights, so tokens sampled after the update are exactly on-policy) or keep (the running
    requests keep their cache: no re-prefill, but their next tokens attend over keys and values the
    old weights computed; each request's prefix-cache salt names the served version, so a new
    request never reuses an older version's blocks; the stream marks those tokens, the mismatch
    figures report them apart as ``fresh_stale_cache``, and the drift gate leaves them out)."""

    def __post_init__(self) -> None:
        if self.num_servers < 1 and not self.servers:
            raise ValueError("fleet.num_servers must be >= 1 (or list running servers in fleet.servers).")
        if not 0 <= self.port < 65536:
            raise ValueError(f"fleet.port={self.port} is not a port; 0 picks free ones.")
        if min(self.startup_timeout_s, self.cooldown_s, self.request_timeout_s) <= 0 or self.request_attempts < 1:
            raise ValueError("fleet timeouts and cooldown_s must be > 0 and request_attempts >= 1.")
        if self.stall_timeout_s is not None and self.stall_timeout_s <= 0:
            raise ValueError(f"fleet.stall_timeout_s={self.stall_timeout_s} must be > 0 (or null: no watchdog).")
        if self.max_restarts < 0:
            raise ValueError("fleet.max_restarts must be >= 0.")
        check_choice("fleet.kv_on_update", self.kv_on_update, KvOnUpdate)
        self._check_per_server_args()

    def _check_per_server_args(self) -> None:
        # list[list[Any]]: OmegaConf turns a bare number of a flat list[str] into a string, but not of
        # a nested one ([[],[--max-num-seqs,64]]); the flags are strings from here on
        self.per_server_vllm_args = [[str(a) for a in argv] for argv in self.per_server_vllm_args]
        if not self.per_server_vllm_args:
            return
        if self.servers or len(self.per_server_vllm_args) > self.num_servers:
            raise ValueError(f"fleet.per_server_vllm_args has {len(self.per_server_vllm_args)} entries for the "
                             f"{0 if self.servers else self.num_servers} server(s) the run starts (fleet.num_servers; "
                             "none with fleet.servers): give at most one per server.")
        for i, argv in enumerate(self.per_server_vllm_args):
            args = ServerArgs(tuple(argv))
            if any(args.given(f) for f in ("--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp")):
                raise ValueError(f"fleet.per_server_vllm_args[{i}] sets a parallel size: every server gets as many "
                                 "GPUs as fleet.vllm_args says; set it there.")

    @property
    def server_args(self) -> ServerArgs:
        return ServerArgs(tuple(self.vllm_args))

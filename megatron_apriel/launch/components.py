"""The processes of a run on one machine, and their command lines:

    server_<i>   ``fleet.num_servers`` x apriel-serve (vLLM + weight receiver), registered in run_dir/fleet/
    actor        python -m megatron_apriel.entrypoints.actor --run-dir RUN_DIR
    trainer      torchrun --nproc_per_node launch.nproc_per_node -m megatron_apriel.entrypoints.trainer_rank
                 --run-dir RUN_DIR

``rollout.source=local`` runs the trainer alone. The actor and the trainer ranks read the run's
config from ``run_dir/config.yaml``, which the launcher writes before it starts them.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from megatron_apriel.config import RunConfig
from megatron_apriel.fleet.registry import serve_command
from megatron_apriel.parallel.devices import DeviceSplit, check_gpus_present, gpus_present, split_devices
from megatron_apriel.parallel.rendezvous import free_port
from megatron_apriel.process import ManagedProcess
from megatron_apriel.run_dir import RunDir

_EXCEPTION = re.compile(r"^(\[rank\d+\]: )?(\w+\.)*\w*(Error|Exception|Interrupt)(: |$)")
"""A Python traceback's last line (``pkg.mod.SomeError: message``), with the ``[rankN]: `` that torchrun
puts before each line of a rank's output."""


@dataclass
class Component(ManagedProcess):
    restarts_left: int = 0
    """Restarts the launcher may still give it after a crash."""

    def tail(self, lines: int = 30) -> str:
        """The exceptions the log reports (what failed, each once), then its last lines."""
        text = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        errors = [line for line in text if _EXCEPTION.match(line) and "ChildFailedError" not in line]
        unique = list(dict.fromkeys(errors))[-3:]
        head = ["errors reported:", *(f"  {e}" for e in unique), "last lines:"] if unique else []
        return "\n".join(head + text[-lines:])


def run_env(run_dir: str) -> dict:
    """What every component gets: caches that libraries write on import stay in the run directory."""
    return {"MPLCONFIGDIR": os.environ.get("MPLCONFIGDIR", str(RunDir(run_dir).cache / "matplotlib"))}


def serves_moe(run: RunConfig) -> bool:
    """Whether the fleet serves a mixture of experts (the tiny base's setting when it is built here)."""
    if run.tiny_base.enabled:
        return run.tiny_base.num_experts > 0
    return bool(run.model.hf_path) and run.model.resolve_arch().is_moe


def server_flags(run: RunConfig, index: Optional[int] = None) -> list[str]:
    """``fleet.vllm_args`` plus what follows from the run: the context length, the seed and, for a
    mixture of experts, the experts each token was routed to (apriel-serve's flag: replayed by the
    trainer with ``rollout.routing_replay``, and compared with its own routing either way); for
    server ``index``, its ``fleet.per_server_vllm_args`` last."""
    args = run.fleet.server_args
    budget = run.actor.max_trajectory_tokens or run.rewards.max_len  # a trajectory's tokens, every turn's
    need = run.actor.max_prompt_tokens + budget
    if args.max_model_len is not None and args.max_model_len < need:
        what = "actor.max_trajectory_tokens" if run.actor.max_trajectory_tokens else "rewards.max_len"
        raise ValueError(f"fleet.vllm_args sets --max-model-len {args.max_model_len} < actor.max_prompt_tokens + "
                         f"{what} = {need}; raise it or lower one of those.")
    args = args.with_default("--max-model-len", str(need)).with_default("--seed", str(run.seed))
    if serves_moe(run):
        args = args.with_default("--return-routed-experts")
    own = run.fleet.per_server_vllm_args
    return list(args.argv) + (list(own[index]) if index is not None and index < len(own) else [])


def device_split(run: RunConfig) -> Optional[DeviceSplit]:
    """This machine's GPUs between the servers the launch starts and the trainer (``parallel/devices.py``)."""
    local_servers = run.fleet.num_servers if run.rollout.source == "fleet" and not run.fleet.servers else 0
    check_gpus_present(run.launch.gpus_per_node, local_servers, gpus_present(os.environ))
    return split_devices(run.launch.gpus_per_node, local_servers, run.fleet.server_args.gpus,
                         run.launch.nproc_per_node, os.environ.get("CUDA_VISIBLE_DEVICES"))


FIRST_CORE_ENV = "APRIEL_FIRST_CORE"
"""CPU runs: the core of server 0's vLLM worker (server i gets the i-th core after it, wrapping
around); two runs on one machine each set their own, so their servers do not share a core."""


def server_core(index: int, env: Mapping[str, str], cores: Sequence[int]) -> Optional[int]:
    """The core server ``index``'s vLLM worker is bound to on a CPU machine: core ``index`` of this
    process's cores, counted from ``APRIEL_FIRST_CORE``, so each server has its own (vLLM's own
    default binds every server's worker to the same core). None: the user binds them
    (``VLLM_CPU_OMP_THREADS_BIND``) or there is one core."""
    if "VLLM_CPU_OMP_THREADS_BIND" in env or len(cores) < 2:
        return None
    first = int(env.get(FIRST_CORE_ENV) or 0)
    return sorted(cores)[(first + index) % len(cores)]


def _on(env: dict, devices: Optional[str]) -> dict:
    """``env`` with these GPUs ("": none, for the actor, which needs none) or, with no split, unchanged."""
    return env if devices is None else {**env, "CUDA_VISIBLE_DEVICES": devices}


def components(run: RunConfig) -> list[Component]:
    """The processes a run starts on this machine (servers, actor, trainer), not yet started."""
    paths = run.paths
    env = run_env(run.run_dir)
    split = device_split(run)
    run_dir = ["--run-dir", run.run_dir]
    out: list[Component] = []
    fleet = run.rollout.source == "fleet"
    if fleet and not run.fleet.servers:
        base = run.fleet.port or None
        for i in range(run.fleet.num_servers):
            port = base + i if base else free_port()
            cmd = serve_command(run.model.hf_path, port, run.fleet.host, server_flags(run, i),
                                register_dir=paths.fleet)
            gpus = split.servers[i] if split else None
            core = None if split or run.launch.gpus_per_node else server_core(i, os.environ, os.sched_getaffinity(0))
            own = env if core is None else {**env, "VLLM_CPU_OMP_THREADS_BIND": str(core)}
            out.append(Component(f"server_{i}", cmd, paths.log(f"server_{i}"), _on(own, gpus),
                                 restarts_left=run.fleet.max_restarts))
    if fleet:
        out.append(Component("actor", [sys.executable, "-m", "megatron_apriel.entrypoints.actor", *run_dir],
                             paths.log("actor"), _on(env, "" if split else None), restarts_left=run.fleet.max_restarts))
    # launch.master_port=0: torchrun binds a free port itself when it starts (--standalone). A port
    # picked here could be taken by then: the servers start first and bind ports of their own.
    rendezvous = ["--master_port", str(run.launch.master_port)] if run.launch.master_port else ["--standalone"]
    out.append(Component("trainer", [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                                     str(run.launch.nproc_per_node), *rendezvous, "-m",
                                     "megatron_apriel.entrypoints.trainer_rank", *run_dir],
                         paths.log("trainer"), _on(env, split.trainer if split else None)))
    return out

"""The local launcher: what ``apriel-train`` does when it is not already a trainer rank.

It checks the inputs (data files, budgets) before anything starts, builds the tiny base model if
the config asks for one, then starts every component of the run on this machine, each in its
own process group with its log in ``run_dir/logs/<component>.log``:

    server_<i>   ``fleet.num_servers`` x apriel-serve (vLLM + weight receiver), registered in run_dir/fleet/
    actor        python -m megatron_apriel.entrypoints.actor (same config and overrides)
    trainer      torchrun --nproc_per_node launch.nproc_per_node -m megatron_apriel.entrypoints.train

It shows a progress bar and each step's metrics (from ``run_dir/logs/metrics.jsonl``), restarts a
crashed server or actor (up to ``fleet.max_restarts`` times each), and when the trainer finishes
stops the others and exports the final checkpoint to ``run_dir/hf/``. On Ctrl-C, SIGTERM or a
component failing for good it stops all of them (by process group, never by name) and exits
non-zero, naming the component and printing the tail of its log. ``rollout.source=local`` runs
the trainer alone. ``launch.dry_run=true`` prints the plan and exits.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import psutil
from omegaconf import DictConfig

from megatron_apriel.config import RunConfig
from megatron_apriel.lifetime import die_with_parent
from megatron_apriel.metrics import CONSOLE_KEYS, METRICS_FILE
from megatron_apriel.parallel.rendezvous import free_port
from megatron_apriel.rollout.fleet import FLEET_DIR, serve_command


@dataclass
class Component:
    name: str
    cmd: list[str]
    log_path: Path
    restarts_left: int = 0
    env: dict = field(default_factory=dict)
    proc: Optional[subprocess.Popen] = None
    _family: list = field(default_factory=list, repr=False)
    """Its descendants when `terminate` signalled it: `stop` kills those that left the group."""

    def start(self) -> None:
        self._family = []
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(self.cmd)}\n")
            log.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, **self.env}, preexec_fn=_die_with_parent)

    @staticmethod
    def run_env(run_dir: str) -> dict:
        """What every component gets: caches that libraries write on import stay in the run directory."""
        return {"MPLCONFIGDIR": os.environ.get("MPLCONFIGDIR", str(Path(run_dir) / ".cache" / "matplotlib"))}

    def poll(self) -> Optional[int]:
        return None if self.proc is None else self.proc.poll()

    def terminate(self) -> None:
        """SIGTERM to the component's process group, without waiting for it (`stop` waits), so that
        several components stop at the same time."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self._family = _descendants(self.proc.pid)
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass  # it exited between the poll and the signal

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the component's process group, SIGKILL after ``grace_s``. Then what is left
        is killed: the rest of the group (vLLM's engine and workers outlive a dead API server) and
        every descendant that left it (torchrun starts each rank in a session of its own, so
        ranks stuck in a collective would outlive a killed torchrun and keep its ports)."""
        if self.proc is None:
            return
        family = list({p.pid: p for p in [*self._family, *_descendants(self.proc.pid)]}.values())
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(grace_s)
            except ProcessLookupError:
                pass  # it exited between the poll and the signal
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # no process of the group is left: the usual case
        for p in family:
            try:
                p.kill()  # psutil checks it is the same process (pid and start time)
            except psutil.NoSuchProcess:
                pass  # it exited with its parent: the usual case

    def tail(self, lines: int = 30) -> str:
        """The exceptions the log reports (what failed, each once), then its last lines."""
        text = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        errors = [line for line in text if _EXCEPTION.match(line) and "ChildFailedError" not in line]
        unique = list(dict.fromkeys(errors))[-3:]
        head = ["errors reported:", *(f"  {e}" for e in unique), "last lines:"] if unique else []
        return "\n".join(head + text[-lines:])


class LaunchError(RuntimeError):
    pass


_EXCEPTION = re.compile(r"^(\w+\.)*\w*(Error|Exception|Interrupt)(: |$)")
"""A Python traceback's last line (``pkg.mod.SomeError: message``)."""


def _descendants(pid: int) -> list:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the launcher dies, even by SIGKILL (Linux), so that
    no component outlives a launcher that could not stop it."""
    die_with_parent(signal.SIGTERM)


def _say(msg: str) -> None:
    from tqdm import tqdm

    tqdm.write(f"[apriel] {msg}", file=sys.stderr)


LAUNCHER_ONLY = ("run_dir=", "launch.dry_run=")
"""Overrides not passed on to the components: the run directory (made absolute) and the dry run."""


def _overrides(run: RunConfig) -> list[str]:
    """This command's own arguments (config name and overrides), with the run directory made absolute."""
    return [a for a in sys.argv[1:] if not a.startswith(LAUNCHER_ONLY)] + [f"run_dir={run.run_dir}"]


def vllm_args(run: RunConfig) -> list[str]:
    """``fleet.vllm_args`` plus what follows from the run: the context length and the seed."""
    args = list(run.fleet.vllm_args)
    need = run.actor.max_prompt_tokens + run.rewards.max_len
    given = [a for a in args if a.startswith("--max-model-len")]
    if not given:
        args += ["--max-model-len", str(need)]
    else:
        value = int(given[0].split("=", 1)[1]) if "=" in given[0] else int(args[args.index(given[0]) + 1])
        if value < need:
            raise ValueError(f"fleet.vllm_args sets --max-model-len {value} < actor.max_prompt_tokens + "
                             f"rewards.max_len = {need}; raise it or lower one of those.")
    if "--seed" not in args:
        args += ["--seed", str(run.seed)]
    return args


def plan(run: RunConfig) -> list[Component]:
    """The processes a run starts on this machine (servers, actor, trainer), not yet started."""
    logs = Path(run.run_dir) / "logs"
    env = Component.run_env(run.run_dir)
    out: list[Component] = []
    fleet = run.rollout.source == "fleet"
    if fleet and not run.fleet.servers:
        base = run.fleet.port or None
        for i in range(run.fleet.num_servers):
            port = base + i if base else free_port()
            cmd = serve_command(run.model.hf_path, port, run.fleet.host, vllm_args(run),
                                register_dir=Path(run.run_dir) / FLEET_DIR)
            out.append(Component(f"server_{i}", cmd, logs / f"server_{i}.log", run.fleet.max_restarts, env))
    if fleet:
        out.append(Component("actor", [sys.executable, "-m", "megatron_apriel.entrypoints.actor", *_overrides(run)],
                             logs / "actor.log", run.fleet.max_restarts, env))
    port = run.launch.master_port or free_port()
    out.append(Component("trainer", [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                                     str(run.launch.nproc_per_node), "--master_port", str(port), "-m",
                                     "megatron_apriel.entrypoints.train", *_overrides(run)],
                         logs / "trainer.log", env=env))
    return out


def prepare_base(run: RunConfig) -> None:
    if not run.tiny_base.enabled:
        return
    from megatron_apriel.tiny.base import build_warm_base

    base = Path(run.model.hf_path)
    if not base.is_dir():
        _say(f"building the tiny base model into {base} (tokenizer, {run.tiny_base.sft_steps} warm-start steps)")
    build_warm_base(base, run.tiny_base)


def preflight(run: RunConfig) -> None:
    """Everything that can be checked before a server, actor or trainer starts: a bad input fails
    here, with the file and row, the key and the value to change."""
    if run.model.hf_path and not run.tiny_base.enabled and not (Path(run.model.hf_path) / "config.json").is_file():
        raise ValueError(f"model.hf_path={run.model.hf_path} has no config.json: give a Hugging Face model directory.")
    if run.rollout.source == "fleet":
        from megatron_apriel.entrypoints.actor import load_pools

        vllm_args(run)
        if not run.launch.dry_run:
            prepare_base(run)
        if not run.launch.dry_run or not run.tiny_base.enabled or Path(run.model.hf_path).is_dir():
            load_pools(run)  # malformed rows, domains without problems (a tiny base writes its own data)


class Launcher:
    def __init__(self, run: RunConfig, components: list[Component]):
        self.run, self.components = run, components
        self.by_name = {c.name: c for c in components}
        self.trainer = self.by_name["trainer"]
        self.metrics_path = Path(run.run_dir) / METRICS_FILE
        self._metrics_pos = self.metrics_path.stat().st_size if self.metrics_path.exists() else 0
        self.rewards: list[float] = []

    def _servers(self) -> list[Component]:
        return [c for c in self.components if c.name.startswith("server_")]

    def start_fleet(self) -> None:
        from megatron_apriel.rollout.fleet import registered
        from megatron_apriel.rollout.stream import clear_progress

        clear_progress(Path(self.run.run_dir) / "rollouts")  # a previous trainer's: the actor waits for the new one
        fleet_dir = Path(self.run.run_dir) / FLEET_DIR
        for stale in fleet_dir.glob("*.json"):  # registrations of an earlier launch
            stale.unlink()
        servers = self._servers()
        if not servers:
            return
        _say(f"starting {len(servers)} vLLM server(s) (logs in {self.run.run_dir}/logs/server_*.log)")
        t0 = time.monotonic()
        for s in servers:
            s.start()
        while len(registered(fleet_dir)) < len(servers):
            for s in servers:
                if s.poll() is not None:
                    raise LaunchError(f"{s.name} exited with code {s.poll()} before it was healthy; last lines of "
                                      f"{s.log_path}:\n{s.tail()}")
            if time.monotonic() - t0 > self.run.fleet.startup_timeout_s:
                raise LaunchError(f"the vLLM servers were not healthy after fleet.startup_timeout_s="
                                  f"{self.run.fleet.startup_timeout_s}s; last lines of {servers[0].log_path}:\n"
                                  f"{servers[0].tail()}")
            time.sleep(0.5)
        _say(f"fleet healthy in {time.monotonic() - t0:.0f}s")

    def _restart_or_fail(self, c: Component, code: int) -> None:
        if c.restarts_left <= 0:
            raise LaunchError(f"{c.name} failed (exit code {code}) and has no restarts left; last lines of "
                              f"{c.log_path}:\n{c.tail()}")
        c.restarts_left -= 1
        _say(f"{c.name} exited with code {code}; restarting it ({c.restarts_left} restarts left)")
        c.stop()  # what is left of its process group goes first
        c.start()

    def _show_metrics(self, bar) -> None:
        if not self.metrics_path.exists():
            return
        with open(self.metrics_path) as f:
            f.seek(self._metrics_pos)
            lines = f.readlines()
            self._metrics_pos = f.tell()
        for line in lines:
            if not line.endswith("\n"):  # a line being written: read it next time
                self._metrics_pos -= len(line)
                break
            m = json.loads(line)
            if "rollout/reward" in m:
                self.rewards.append(m["rollout/reward"])
            bar.update(m["step"] + 1 - bar.n)
            shown = " ".join(f"{k.split('/')[-1]}={m[k]:.4g}" for k in CONSOLE_KEYS if k in m)
            bar.write(f"step {m['step']} | {shown}", file=sys.stderr)

    def watch(self) -> int:
        """Until the trainer exits: restart crashed servers/actor, show progress. Trainer's exit code."""
        from tqdm import tqdm

        with tqdm(total=self.run.trainer.steps, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True,
                  disable=not sys.stderr.isatty()) as bar:
            while True:
                self._show_metrics(bar)
                code = self.trainer.poll()
                if code is not None:
                    self._show_metrics(bar)
                    return code
                for c in self.components:
                    if c is not self.trainer and (rc := c.poll()) is not None:
                        self._restart_or_fail(c, rc)
                time.sleep(0.5)

    def stop_all(self) -> None:
        """The trainer first (it may be sending weights to the servers, and it saves its step), then
        every other component at once: all get SIGTERM together, then each is waited for."""
        self.trainer.stop()
        others = [c for c in reversed(self.components) if c is not self.trainer]
        running = [c.name for c in others if c.proc is not None and c.poll() is None]
        t0 = time.monotonic()
        for c in others:
            c.terminate()
        for c in others:
            c.stop()  # also what an exited one left in its group
        if running:
            _say(f"stopped {', '.join(running)} in {time.monotonic() - t0:.1f}s")


def _checkpointed_step(run: RunConfig) -> Optional[int]:
    from megatron_apriel.trainer.checkpoint import latest_checkpoint

    latest = latest_checkpoint(Path(run.run_dir) / "checkpoints")
    return None if latest is None else json.loads((latest / "state.json").read_text())["step"]


def export_hf(run: RunConfig) -> Optional[Path]:
    """The newest checkpoint as a Hugging Face model in run_dir/hf (replaced if it exists)."""
    import shutil

    from megatron_apriel.convert.checkpoint import mcore_to_hf
    from megatron_apriel.trainer.checkpoint import latest_checkpoint

    latest = latest_checkpoint(Path(run.run_dir) / "checkpoints")
    if latest is None:
        return None
    out = Path(run.run_dir) / "hf"
    shutil.rmtree(out, ignore_errors=True)
    mcore_to_hf(latest / "dist", out, hf_reference=run.model.hf_path, progress=False)
    return out


def describe(run: RunConfig, components: list[Component]) -> str:
    """The dry run's report: processes, ranks and resources."""
    from megatron_apriel.convert.mapping import canonical_shapes
    from megatron_apriel.parallel.dims import ParallelDims

    known = run.model.hf_path is None or (Path(run.model.hf_path) / "config.json").is_file()  # tiny base: not built yet
    arch = run.model.resolve_arch() if known else None
    lines = [f"run_dir: {run.run_dir}"]
    if arch is not None:
        arch.check_sequence_length(run.trainer.seq_len)
        params = sum(_numel(s) for s in canonical_shapes(arch).values())
        lines.append(f"model: {run.model.hf_path or 'inline arch'} ({arch.family}, {arch.num_layers} layers, hidden "
                     f"{arch.hidden_size}, {params / 1e9:.2f}B parameters)")
    world = run.launch.nnodes * run.launch.nproc_per_node
    dims = ParallelDims.resolve(run.parallel, world)
    lines.append(f"trainer: {run.launch.nnodes} node(s) x {run.launch.nproc_per_node} rank(s) = TP {dims.tp} x "
                 f"PP {dims.pp} x DP {dims.dp}; "
                 f"{run.trainer.steps} steps of {run.rollout.groups_per_step} groups x G={run.rollout.group_size}; "
                 f"seq_len {run.trainer.seq_len}, packing={run.trainer.packing}")
    if run.rollout.source == "fleet":
        lines.append(f"rollouts: vLLM fleet -> actor -> {run.run_dir}/rollouts; budget {run.rewards.max_len} tokens, "
                     f"temperature {run.loss.temperature}, max_lag {run.rollout.max_lag}, "
                     f"mix {run.actor.sampler.mix}")
        lines.append(f"weight sync: every step, backend {run.weight_sync.backend}, buckets of "
                     f"{run.weight_sync.bucket_bytes / 2**20:.0f} MiB, stage ports from {run.weight_sync.base_port}")
        if run.fleet.servers:
            lines.append(f"servers (already running): {run.fleet.servers}")
    lines.append("processes:")
    lines += [f"  {c.name:<9} {' '.join(c.cmd)}" for c in components]
    return "\n".join(lines)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def launch(run: RunConfig, raw: DictConfig) -> int:
    """Run the whole job on this machine; returns the process exit code."""
    try:
        preflight(run)  # the dry run runs the same checks: it says what the launch would refuse
        components = plan(run)
        report = describe(run, components) if run.launch.dry_run else ""
    except (ValueError, FileNotFoundError) as err:
        _say(f"error: {err}")
        return 2
    many_nodes = (f"launch.nnodes={run.launch.nnodes}: apriel-train starts one machine. Submit it with apriel-submit "
                  "(SLURM), or run the trainer ranks with srun/torchrun on every node, the servers with apriel-serve "
                  "and the actor with `python -m megatron_apriel.entrypoints.actor` (same config), or set "
                  "launch.nnodes=1.")
    if run.launch.dry_run:
        print(report + (f"\nthe launch would refuse: {many_nodes}" if run.launch.nnodes > 1 else ""))
        return 0
    if run.launch.nnodes > 1:
        _say(f"error: {many_nodes}")
        return 2
    launcher = Launcher(run, components)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_interrupt)
    try:
        launcher.start_fleet()
        for c in components:
            if not c.name.startswith("server_"):
                c.start()
        started = "actor and " if "actor" in launcher.by_name else ""
        _say(f"{started}{run.launch.nproc_per_node} trainer rank(s) started; logs in {run.run_dir}/logs, "
             f"TensorBoard: tensorboard --logdir {run.run_dir}/tensorboard")
        code = launcher.watch()
    except LaunchError as err:
        _say(f"error: {err}")
        return 1
    except KeyboardInterrupt:
        _say("interrupted: stopping every component")
        return 130
    finally:
        launcher.stop_all()
    if code != 0:
        _say(f"trainer failed (exit code {code}); last lines of {launcher.trainer.log_path}:\n"
             f"{launcher.trainer.tail()}")
        return code
    done = _checkpointed_step(run)
    if done is not None and done < run.trainer.steps:
        _say(f"the trainer stopped at step {done} of {run.trainer.steps} (stop signal) and saved it; run the same "
             "command again to resume")
        return 0
    if run.launch.export_hf:
        out = export_hf(run)
        if out is not None:
            _say(f"exported the final checkpoint to {out}")
    if launcher.rewards:
        k = min(10, len(launcher.rewards))
        _say(f"done: reward {sum(launcher.rewards[:k]) / k:.3f} (first {k} steps) -> "
             f"{sum(launcher.rewards[-k:]) / k:.3f} (last {k})")
    return 0


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt

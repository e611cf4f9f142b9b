"""The local launcher: what ``apriel-train`` does when it is not already a trainer rank.

It runs the preflight checks before anything starts (and builds the tiny base model if the
config asks for one), then starts every component of the run on this machine (``components.py``),
each in its own process group with its log in ``run_dir/logs/<component>.log``. It shows a
progress bar and each step's metrics, restarts a crashed server or actor (up to
``fleet.max_restarts`` times each), and when the trainer finishes stops the others and exports
the final checkpoint to ``run_dir/hf/``. On Ctrl-C, SIGTERM or a component failing for good it
stops all of them (by process group, never by name) and exits non-zero, naming the component and
printing the tail of its log. ``launch.dry_run=true`` runs the same checks, prints the report and
exits.
"""

from __future__ import annotations

import signal
import sys
import time

from megatron_apriel.config import RunConfig, save_run_config
from megatron_apriel.launch.components import Component, components
from megatron_apriel.launch.export import checkpointed_step, export_hf
from megatron_apriel.launch.preflight import preflight
from megatron_apriel.launch.progress import MetricsTail, say
from megatron_apriel.launch.report import describe
from megatron_apriel.refusals import REFUSALS, refuse


class LaunchError(RuntimeError):
    pass


class Launcher:
    def __init__(self, run: RunConfig, parts: list[Component]):
        self.run, self.components = run, parts
        self.by_name = {c.name: c for c in parts}
        self.trainer = self.by_name["trainer"]
        self.metrics = MetricsTail(run.paths.metrics)

    def _servers(self) -> list[Component]:
        return [c for c in self.components if c.name.startswith("server_")]

    def start_fleet(self) -> None:
        from megatron_apriel.fleet.registry import registered
        from megatron_apriel.records.stream import clear_progress

        paths = self.run.paths
        clear_progress(paths.rollouts)  # a previous trainer's: the actor waits for the new one
        paths.clear_registrations()  # an earlier launch's
        fleet_dir = paths.fleet
        servers = self._servers()
        if not servers:
            return
        say(f"starting {len(servers)} vLLM server(s) (logs in {self.run.run_dir}/logs/server_*.log)")
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
        say(f"fleet healthy in {time.monotonic() - t0:.0f}s")

    def _restart_or_fail(self, c: Component, code: int) -> None:
        if c.restarts_left <= 0:
            raise LaunchError(f"{c.name} failed (exit code {code}) and has no restarts left; last lines of "
                              f"{c.log_path}:\n{c.tail()}")
        c.restarts_left -= 1
        say(f"{c.name} exited with code {code}; restarting it ({c.restarts_left} restarts left)")
        c.stop()  # what is left of its process group goes first
        c.start()

    def watch(self) -> int:
        """Until the trainer exits: restart crashed servers/actor, show progress. Trainer's exit code."""
        from tqdm import tqdm

        with tqdm(total=self.run.trainer.steps, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True,
                  disable=not sys.stderr.isatty()) as bar:
            while True:
                self.metrics.show(bar)
                code = self.trainer.poll()
                if code is not None:
                    self.metrics.show(bar)
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
        running = [c.name for c in others if c.running()]
        t0 = time.monotonic()
        for c in others:
            c.terminate()
        for c in others:
            c.stop()  # also what an exited one left in its group
        if running:
            say(f"stopped {', '.join(running)} in {time.monotonic() - t0:.1f}s")


MANY_NODES = ("launch.nnodes={n}: apriel-train starts one machine. Submit it with apriel-submit (SLURM), or run "
              "the trainer ranks with srun/torchrun on every node, the servers with apriel-serve and the actor with "
              "`python -m megatron_apriel.entrypoints.actor` (same config), or set launch.nnodes=1.")


def launch(run: RunConfig) -> int:
    """Run the whole job on this machine; returns the process exit code. The components read the
    run's config from ``run_dir/config.yaml``, written here once the checks pass (not by a dry run)."""
    try:
        preflight(run)  # the dry run runs the same checks: it says what the launch would refuse
        parts = components(run)
        report = describe(run, parts) if run.launch.dry_run else ""
    except REFUSALS as err:
        refuse("apriel-train", err)
    many_nodes = MANY_NODES.format(n=run.launch.nnodes)
    if run.launch.dry_run:
        print(report + (f"\nthe launch would refuse: {many_nodes}" if run.launch.nnodes > 1 else ""))
        return 0
    if run.launch.nnodes > 1:
        refuse("apriel-train", many_nodes)
    save_run_config(run)
    return _run(run, Launcher(run, parts))


def _run(run: RunConfig, launcher: Launcher) -> int:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_interrupt)
    try:
        launcher.start_fleet()
        for c in launcher.components:
            if not c.name.startswith("server_"):
                c.start()
        started = "actor and " if "actor" in launcher.by_name else ""
        say(f"{started}{run.launch.nproc_per_node} trainer rank(s) started; logs in {run.run_dir}/logs, "
            f"TensorBoard: tensorboard --logdir {run.run_dir}/tensorboard")
        code = launcher.watch()
    except LaunchError as err:
        say(f"error: {err}")
        return 1
    except KeyboardInterrupt:
        say("interrupted: stopping every component")
        return 130
    finally:
        launcher.stop_all()
    return _finish(run, launcher, code)


def _finish(run: RunConfig, launcher: Launcher, code: int) -> int:
    if code != 0:
        say(f"trainer failed (exit code {code}); last lines of {launcher.trainer.log_path}:\n{launcher.trainer.tail()}")
        return code
    done = checkpointed_step(run)
    if done is not None and done < run.trainer.steps:
        say(f"the trainer stopped at step {done} of {run.trainer.steps} (stop signal) and saved it; run the same "
            "command again to resume")
        return 0
    if run.launch.export_hf:
        out = export_hf(run)
        if out is not None:
            say(f"exported the final checkpoint to {out}")
    if summary := launcher.metrics.summary():
        say(f"done: {summary}")
    return 0


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt

"""The actor process: problems -> vLLM fleet -> verifiers -> rewards -> the durable rollout stream.

    python -m megatron_apriel.entrypoints.actor --run-dir /shared/runs/x

Reads the run's config from ``run_dir/config.yaml`` (its launcher wrote it); ``apriel-train``
starts it by itself on one machine, SLURM runs it on a rollout node. It finds the servers in ``fleet.servers`` or in
``run_dir/fleet/`` and resumes from the stream in ``run_dir/rollouts/`` if there is one. Stops
cleanly (writing what has finished) on SIGTERM or SIGINT.

This module is the actor's composition root: it builds every collaborator from the config.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import signal
from typing import Optional

from megatron_apriel.config import RunConfig, load_run_config
from megatron_apriel.logs import setup_logging

log = logging.getLogger("megatron_apriel.actor")


def verifier_pool(run: RunConfig):
    """The actor's verifier processes, each with the run's verifier settings (``actor.verifiers.*``)."""
    from megatron_apriel.verifiers import make_verifier_pool

    return make_verifier_pool(run.actor.verifier_workers, run.actor.verifiers)


def episode_workers(run: RunConfig):
    """The actor's episode processes (``actor/episodes.py``), each with every environment built
    from the run's settings (``actor.envs.*``, the verifiers' ``actor.verifiers.*``)."""
    from megatron_apriel.actor.episodes import EpisodeWorkers, environments_for_run

    return EpisodeWorkers(run.actor.verifier_workers,
                          functools.partial(environments_for_run, run.actor.envs, run.actor.verifiers))


def check_environments(run: RunConfig, pools) -> None:
    """Every environment the run's problems will use exists (``actor.environments`` and the
    problems' ``metadata["environment"]``), with an error that says how to fix it; and the chat
    template's append check (``actor/trajectory.py``), logged."""
    from megatron_apriel.envs.registry import ENVIRONMENTS
    from megatron_apriel.records.rollouts import DOMAINS

    for domain, env in run.actor.environments.items():
        if domain not in DOMAINS:
            raise ValueError(f"actor.environments.{domain}: unknown domain; the domains are {DOMAINS}.")
        if env not in ENVIRONMENTS:
            raise ValueError(f"actor.environments.{domain}={env}: no such environment; registered: "
                             f"{sorted(ENVIRONMENTS)} (add yours to envs/registry.py, docs/environments.md).")
    for domain in pools.domains:
        names = {run.actor.environment(domain, p.metadata) for p in pools.problems(domain)}
        unknown = sorted(names - set(ENVIRONMENTS))
        if unknown:
            raise ValueError(f"problems of {domain} name the environments {unknown} (metadata['environment']), "
                             f"which are not registered: {sorted(ENVIRONMENTS)}.")


async def _run_actor(run: RunConfig) -> None:
    from megatron_apriel.actor.loop import Actor
    from megatron_apriel.actor.trajectory import PROBE, ChatTokens
    from megatron_apriel.data.datasets import training_pools
    from megatron_apriel.data.order import DomainOrder
    from megatron_apriel.fleet.client import FleetClient
    from megatron_apriel.fleet.registry import fleet_urls, registered
    from megatron_apriel.metrics import TensorBoardLogger
    from megatron_apriel.records.stream import StreamWriter
    from megatron_apriel.tokenizer import load_tokenizer

    pools = training_pools(run.actor.data, run.actor.sampler.mix)
    check_environments(run, pools)
    tokenizer = load_tokenizer(run.model.hf_path)
    differs = ChatTokens(tokenizer).append_only(PROBE)
    if differs:
        log.warning("the chat template is not append-only (%s): multi-turn records stay token-exact (the ids the "
                    "model saw), but differ from a re-render of the whole conversation", differs)
    urls = fleet_urls(run.fleet, run.run_dir)
    client = FleetClient(urls, max_attempts=run.fleet.request_attempts, cooldown_s=run.fleet.cooldown_s,
                         timeout_s=run.fleet.request_timeout_s, stall_timeout_s=run.fleet.stall_timeout_s,
                         salt_cache=run.fleet.kv_on_update == "keep")
    episodes = episode_workers(run)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    fleet_dir = run.paths.fleet
    members = None if run.fleet.servers else (lambda: [(r.url, r.instance) for r in registered(fleet_dir)])
    sampler = run.actor.sampler.build()
    actor = Actor(cfg=run.actor, rollout=run.rollout, rewards=run.rewards, sampling=run.sampling, client=client,
                  sampler=sampler, order=DomainOrder(pools, seed=run.seed), tokenizer=tokenizer,
                  stream=StreamWriter(run.paths.rollouts), episodes=episodes,
                  metrics=TensorBoardLogger(run.paths.actor_tensorboard), members=members)
    log.info("actor: %d servers, domains %s, G=%d, %d groups/step, max_lag=%s", len(urls),
             {d: pools.size(d) for d in pools.domains}, run.rollout.group_size, run.rollout.groups_per_step,
             run.rollout.max_lag)
    try:
        await actor.run(stop)
    finally:
        await client.aclose()
        episodes.shutdown()
        actor.metrics.close()
    log.info("actor stopped: %d groups in the stream", actor.stream.next_seq)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m megatron_apriel.entrypoints.actor", description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", required=True, help="the run directory its launcher prepared")
    args = p.parse_args(argv)
    setup_logging("actor")
    asyncio.run(_run_actor(load_run_config(args.run_dir)))


if __name__ == "__main__":
    main()

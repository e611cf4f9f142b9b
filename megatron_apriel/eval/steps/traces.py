"""What the analysis reads: the responses of finished evaluations, and how their tokens are counted.

An evaluation is an ``apriel-eval run`` output directory: ``samples/<benchmark>.jsonl`` (every
scored sample, `eval.results`), ``report.json`` (its label) and ``manifest.json`` (its checkpoint).
A trace is a sample's whole decoded completion (``text``), answer block included. Tokens per step
are counted with the evaluated model's tokenizer, found where the evaluation records it (the
manifest's checkpoint, its ``OUT/hf_converted`` conversion, or a dist checkpoint's run base
model), or with ``--tokenizer``; with none found they are whitespace-separated words, and the
report says so and why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from megatron_apriel.eval.results import ResultsFile

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class Trace:
    benchmark: str
    problem_id: str
    sample: int
    text: str
    success: bool


@dataclass(frozen=True)
class Evaluation:
    """One evaluation's directory, its label and the responses selected from it."""

    path: Path
    label: str
    traces: tuple[Trace, ...]
    benchmarks: tuple[str, ...]


def evaluation_label(path: Path) -> str:
    report = path / "report.json"
    if report.is_file():
        label = json.loads(report.read_text()).get("label")
        if isinstance(label, str) and label:
            return label
    return path.resolve().name


def load_evaluation(path: Path, benchmarks: Sequence[str] = (), all_responses: bool = False) -> Evaluation:
    """The correct responses (every one with ``all_responses``) of ``benchmarks`` (default: all)."""
    path = Path(path)
    files = sorted((path / "samples").glob("*.jsonl"))
    if not files:
        raise ValueError(f"{path}: no samples/*.jsonl; give the output directory of a finished apriel-eval run.")
    held = [f.stem for f in files]
    unknown = sorted(set(benchmarks) - set(held))
    if unknown:
        raise ValueError(f"{path}: no benchmark {unknown}; it holds {held}.")
    names = [n for n in held if not benchmarks or n in benchmarks]
    traces = []
    for name in names:
        records = ResultsFile(path / "samples" / f"{name}.jsonl").load(repair=False)
        traces += [Trace(benchmark=name, problem_id=r.problem_id, sample=r.sample, text=r.text, success=r.success)
                   for _, r in sorted(records.items()) if all_responses or r.success]
    return Evaluation(path=path, label=evaluation_label(path), traces=tuple(traces), benchmarks=tuple(names))


class TokenCounter(Protocol):
    description: str

    def count(self, texts: list[str]) -> list[int]: ...


class WhitespaceCounter:
    def __init__(self, why: str) -> None:
        self.description = f"whitespace-separated words, not model tokens ({why})"

    def count(self, texts: list[str]) -> list[int]:
        return [len(t.split()) for t in texts]


class TokenizerCounter:
    def __init__(self, path: Path) -> None:
        from megatron_apriel.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(path)
        self.description = f"tokens of the tokenizer in {path} (each step encoded alone, no special tokens)"

    def count(self, texts: list[str]) -> list[int]:
        if not texts:
            return []
        return [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _has_tokenizer(path: Path) -> bool:
    return any((path / f).is_file() for f in TOKENIZER_FILES)


def find_tokenizer(evaluation: Path) -> tuple[Path | None, str]:
    """(the evaluated model's tokenizer directory or None, where it was looked for)."""
    from megatron_apriel.eval.serving import CONVERTED, _dist_dir, run_base_model

    manifest = evaluation / "manifest.json"
    if not manifest.is_file():
        return None, f"{manifest} is missing, so the evaluated checkpoint is unknown"
    checkpoint = Path(json.loads(manifest.read_text())["checkpoint"])
    candidates = [checkpoint, evaluation / CONVERTED]
    dist = _dist_dir(checkpoint) if checkpoint.is_dir() else None
    base = run_base_model(dist) if dist is not None else None
    candidates += [base] if base is not None else []
    for candidate in candidates:
        if candidate.is_dir() and _has_tokenizer(candidate):
            return candidate, f"found in {candidate}"
    return None, f"no tokenizer files in {', '.join(map(str, candidates))}; pass --tokenizer DIR"


def token_counter(evaluation: Path, tokenizer: str | None) -> TokenCounter:
    """``--tokenizer DIR`` (``whitespace``: words), else the evaluation's own, else words."""
    if tokenizer == "whitespace":
        return WhitespaceCounter("--tokenizer whitespace")
    if tokenizer:
        if not _has_tokenizer(Path(tokenizer)):
            raise ValueError(f"--tokenizer {tokenizer}: no tokenizer files ({', '.join(TOKENIZER_FILES)}) there.")
        return TokenizerCounter(Path(tokenizer))
    found, why = find_tokenizer(evaluation)
    return TokenizerCounter(found) if found is not None else WhitespaceCounter(why)

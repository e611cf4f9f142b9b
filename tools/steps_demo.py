"""The figures of docs/evaluation.md's reasoning-step section: ``apriel-eval steps --compare`` on two
small hand-written evaluations (a verbose "base" and a concise "trained" model answering sums),
once with the offline segmenter and once with the fake judge of the tests (keyword labels).

    python -m tools.steps_demo docs    # writes docs/steps_offline.png and docs/steps_judged.png

The traces are written here, not sampled: they show what the tool draws, not a result. With
``--evals BASE TRAINED`` (two ``apriel-eval run`` outputs, e.g. the tiny model's base and its RL
checkpoint) the same two figures are drawn from their sampled responses, every one (``--all``), as
``steps_tiny_{offline,judged}.png``:

    python -m tools.steps_demo docs --evals evals/base evals/step_00000040
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from megatron_apriel.entrypoints.eval import main as apriel_eval
from megatron_apriel.testing.fake_judge import FakeJudge
from tests.steps_fixtures import write_evaluation

SUMS = [(1, 2), (3, 4), (2, 2), (0, 4), (4, 3), (1, 1)]
ANSWER = "[BEGIN FINAL RESPONSE]\\boxed{{{s}}}[END FINAL RESPONSE]"
BASE = ("We are given {a} + {b}, and the problem asks for the sum.\n\nLet me add them one at a time: {a} and then "
        "{b} more makes {s}.\n\n{extra}Again, {a} plus {b} is {s}, as computed.\n\nAs I said, the sum is {s}.\n\n"
        + ANSWER)
BASE_EXTRA = ("Wait, that may be wrong: let me recount instead, counting up from {a}.\n\n", "")
TRAINED = ("First, add the two numbers.\n\n{a} + {b} = {s}.\n\n{extra}Check: {s} - {b} = {a}.\n\n" + ANSWER)
TRAINED_EXTRA = ("To get {s} we would require {b} more than {a}, which holds.\n\n", "")


def traces(template: str, extras: tuple[str, str]) -> list[tuple[str, bool]]:
    return [(template.format(a=a, b=b, s=a + b, extra=extras[i % 2].format(a=a, b=b, s=a + b)), True)
            for i, (a, b) in enumerate(SUMS)]


def draw(evals: list[str], tmp: str, out: Path, prefix: str) -> None:
    """``--compare`` of ``evals`` (base, trained, options), offline and with the fake judge."""
    assert apriel_eval(["steps", "--compare", *evals, "--out", f"{tmp}/offline"]) == 0
    with FakeJudge() as judge:
        assert apriel_eval(["steps", "--compare", *evals, "--out", f"{tmp}/judged", "--judge-url", judge.url,
                            "--judge-model", "fake-judge"]) == 0
    out.mkdir(parents=True, exist_ok=True)
    for kind in ("offline", "judged"):
        (out / f"{prefix}_{kind}.png").write_bytes(Path(tmp, kind, "steps_sums.png").read_bytes())
        print(f"wrote {out / f'{prefix}_{kind}.png'}")


def main(out: Path, sampled: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        if sampled:  # analysed where they are: the reports and the verdict cache go beside them
            draw([*sampled, "--all", "--labels", "base", "rl", "--no-progress"], tmp, out, "steps_tiny")
            return
        base = write_evaluation(Path(tmp) / "base", "base", {"sums": traces(BASE, BASE_EXTRA)})
        trained = write_evaluation(Path(tmp) / "trained", "trained", {"sums": traces(TRAINED, TRAINED_EXTRA)})
        draw([str(base), str(trained), "--no-progress", "--tokenizer", "whitespace"], tmp, out, "steps")


if __name__ == "__main__":
    args = sys.argv[1:]
    evals = args[args.index("--evals") + 1:args.index("--evals") + 3] if "--evals" in args else []
    main(Path(args[0] if args and args[0] != "--evals" else "docs"), evals)

"""Evaluation (``apriel-eval``): benchmarks in their public formats, resumable sampling through
the vLLM fleet, scoring with the training verifiers, reports and accuracy-versus-tokens plots.

Layout: ``benchmarks.py`` (what to read), ``runner.py`` (sample and score one benchmark),
``results.py`` (the append-only samples file), ``metrics.py`` and ``summary.py`` (the numbers,
pure), ``report.py`` (JSON, Markdown, console), ``plots.py``, ``serving.py`` (what is served),
``session.py`` (an output directory and its benchmarks); ``entrypoints/eval.py`` composes them.
"""

"""``apriel-eval steps``: reasoning-trace analysis (RECIPE.md section 11, the paper's Appendix D).

Each selected response is cut into contiguous verbatim steps, by an LLM judge that also labels
each step (one of eight), or by an offline rule-based segmenter (steps only); per model and
benchmark the report gives steps per response, tokens per step and the label shares, and
``--compare`` sets a base model against a trained one.

Layout, one concern per file: ``prompts.py`` (the labels and the versioned ``prompts_v<N>.yaml``),
``offline.py`` (the rule-based segmenter), ``windows.py`` (long traces), ``validate.py`` (a judge's
answer checked), ``align.py`` (its steps placed in the trace, whitespace forgiven), ``judge.py``
(the OpenAI-compatible client), ``cache.py`` (verdicts by digest), ``traces.py`` (the evaluations
read, tokens counted), ``stats.py`` (the numbers, pure), ``analyse.py`` (one evaluation end to
end), ``report.py`` and ``compare.py`` (text and figures).
"""

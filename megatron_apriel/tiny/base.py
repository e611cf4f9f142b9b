"""The tiny CPU run's base model: a toy verifiable task and a short supervised warm start.

A random 2-layer model cannot produce a single well-formed answer, so RL would have no signal.
``build_warm_base`` therefore writes, into one directory:
- ``addition.jsonl``: single-digit additions as math-domain problems ("What is 3 + 5?" with the
  usual ``\\boxed{}`` instruction), scored by the real math verifier;
- a tiny Llama (or, with ``tiny_base.num_experts``, Qwen3-MoE) checkpoint and tokenizer
  (``tiny/model.py``; the tokenizer also sees the
  task's text, so an answer is ~10 tokens instead of ~40), briefly trained with teacher forcing on
  answers in Apriel's output format ``[BEGIN FINAL RESPONSE]\\boxed{8}[END FINAL RESPONSE]``.

The warm start stops early (``sft_steps``), so the model has learnt the format but answers only
some sums correctly: sampled at temperature 1 its reward starts well below 1 and RL has room to
raise it. Everything is seeded; the directory is built once and reused (``ready`` marker).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from megatron_apriel.records.rollouts import Problem
from megatron_apriel.tiny.config import TinyBaseConfig

# The verifiers' markers and the converters' math instruction, imported lazily: this module's
# config is part of RunConfig, which must stay light to import (the verifiers pull in sympy,
# reasoning-gym and matplotlib).

PROBLEMS_FILE = "addition.jsonl"
_READY = "ready.json"


def answer_text(value: int) -> str:
    from megatron_apriel.verifiers.base import BEGIN_FINAL, END_FINAL

    return f"{BEGIN_FINAL}\\boxed{{{value}}}{END_FINAL}"


def addition_problems(max_operand: int) -> list[Problem]:
    from megatron_apriel.data.converters import MATH_SUFFIX

    return [Problem(id=f"add-{a}-{b}", domain="math",
                    prompt=[{"role": "user", "content": f"What is {a} + {b}?{MATH_SUFFIX}"}],
                    reference=str(a + b), metadata={"source": "tiny_addition"})
            for a in range(max_operand + 1) for b in range(max_operand + 1)]


def addition_examples(problems: list[Problem]) -> list[tuple[list[dict], str]]:
    """(chat prompt, answer text) of each addition: the warm start's supervised pairs."""
    return [(p.prompt, answer_text(int(p.reference))) for p in problems]


def _sft(model, tok, examples: list[tuple[list[dict], str]], cfg: TinyBaseConfig) -> None:
    """Teacher-forced cross-entropy on the answer tokens only (prompt tokens carry no loss)."""
    import torch

    rows = []
    for prompt_messages, answer in examples:
        prompt = tok.apply_chat_template(prompt_messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        rows.append((prompt, tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]))
    width = max(len(a) + len(b) for a, b in rows)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=0.0)
    rng = random.Random(cfg.seed)
    model.train()
    for _ in range(cfg.sft_steps):
        batch = [rows[rng.randrange(len(rows))] for _ in range(cfg.sft_batch)]
        ids = torch.full((len(batch), width), tok.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        for i, (prompt, answer) in enumerate(batch):
            seq = prompt + answer
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, len(prompt) : len(seq)] = torch.tensor(answer)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def build_warm_base(out_dir: str | Path, cfg: TinyBaseConfig) -> Path:
    """Write the additions, tokenizer and warm-started weights into ``out_dir`` (once; atomic)."""
    problems = addition_problems(cfg.max_operand)
    return build_task_base(out_dir, cfg, problems, addition_examples(problems))


def build_task_base(out_dir: str | Path, cfg: TinyBaseConfig, problems: list[Problem],
                    examples: list[tuple[list[dict], str]]) -> Path:
    """A tiny base warm-started on ``examples`` ((chat prompt, answer text) pairs), with
    ``problems`` written beside it as ``addition.jsonl`` (``PROBLEMS_FILE``); built once (a
    ``ready`` marker), atomically. The tokenizer also learns the examples' text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_apriel.data.datasets import write_problems
    from megatron_apriel.tiny.model import TinySpec, build_tiny_model

    out = Path(out_dir)
    if (out / _READY).is_file():
        return out
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    corpus = [prompt[0]["content"] + answer for prompt, answer in examples]
    spec = TinySpec(seed=cfg.seed, num_experts=cfg.num_experts, max_position_embeddings=cfg.max_positions)
    build_tiny_model(staging, spec, extra_corpus=corpus)
    tok = AutoTokenizer.from_pretrained(staging)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(staging, dtype=torch.float32)
    _sft(model, tok, examples, cfg)
    model.save_pretrained(staging, safe_serialization=True)
    write_problems(staging / PROBLEMS_FILE, problems)
    (staging / _READY).write_text(json.dumps({"problems": len(problems), "sft_steps": cfg.sft_steps}))
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return out

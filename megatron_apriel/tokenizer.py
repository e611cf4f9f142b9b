"""Loading a checkpoint's tokenizer, the cheap way when that gives the same tokenizer.

``AutoTokenizer`` imports torch and transformers' generation and model-auto modules (~5 CPU-s
here, in every actor and ``apriel-eval`` start) just to pick a class. A checkpoint whose
``tokenizer_config.json`` names the generic fast tokenizer (``TokenizersBackend`` in
transformers 5, ``PreTrainedTokenizerFast`` in both) gets exactly that class from
``AutoTokenizer`` anyway, so it is built directly; any other checkpoint (a model-specific class,
a slow or SentencePiece tokenizer, no config) still goes through ``AutoTokenizer``.
"""

from __future__ import annotations

import json
from pathlib import Path

GENERIC_FAST_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def tokenizer_class_name(model_dir: str | Path) -> str | None:
    """The ``tokenizer_class`` that ``model_dir/tokenizer_config.json`` names (None: no such file
    or entry)."""
    path = Path(model_dir) / "tokenizer_config.json"
    if not path.is_file():
        return None
    with open(path) as f:
        return json.load(f).get("tokenizer_class")


def load_tokenizer(model_dir: str | Path):
    """The tokenizer ``AutoTokenizer.from_pretrained(model_dir)`` would give."""
    model_dir = str(model_dir)
    if tokenizer_class_name(model_dir) in GENERIC_FAST_CLASSES and (Path(model_dir) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)

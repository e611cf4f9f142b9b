"""``load_tokenizer``: the generic fast tokenizer is built without ``AutoTokenizer`` and is the same
tokenizer; any other class still goes through ``AutoTokenizer``."""

from __future__ import annotations

import json

import pytest

from megatron_apriel.tiny.model import TinySpec, build_tokenizer
from megatron_apriel.tokenizer import load_tokenizer, tokenizer_class_name


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(TinySpec(vocab_size=300, training_files=8)).save_pretrained(out)
    return out


def test_the_generic_class_loads_the_same_tokenizer_as_autotokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    assert tokenizer_class_name(tokenizer_dir) in {"TokenizersBackend", "PreTrainedTokenizerFast"}
    ours, auto = load_tokenizer(tokenizer_dir), AutoTokenizer.from_pretrained(tokenizer_dir)
    assert type(ours) is type(auto)
    text = "def f(x):\n    return x + 12  # ünïcode"
    assert ours(text)["input_ids"] == auto(text)["input_ids"]
    assert ours.decode(auto(text)["input_ids"]) == auto.decode(auto(text)["input_ids"])
    messages = [{"role": "user", "content": "2 + 3 = ?"}]
    assert (ours.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            == auto.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (auto.bos_token_id, auto.eos_token_id,
                                                                        auto.pad_token_id)


def test_another_class_goes_through_autotokenizer(tokenizer_dir, tmp_path, monkeypatch):
    import transformers

    for f in tokenizer_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "SomeModelTokenizer"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    seen = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(lambda cls, d: seen.append(d)))
    load_tokenizer(tmp_path)
    assert seen == [str(tmp_path)]

"""hf-to-mcore keeps resident memory flat in the number of layers (issue 4: "no full model in RAM").

Each conversion runs in a fresh subprocess that samples its own anonymous resident memory
(RssAnon in /proc/self/status) every 2 ms; a model with twice the layers must not raise the peak
by more than a quarter of the bytes it adds. Staging every layer in memory, or a heap that keeps
each freed layer (what glibc's dynamic mmap threshold did to the old converter), fails it.
Mapped file pages (RssFile) are clean and reclaimable, so they are not counted.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megatron_apriel.convert.hf_io import HFReader

pytestmark = pytest.mark.integration  # its tests start processes of their own

REPO = Path(__file__).resolve().parents[3]
HIDDEN, FFN, VOCAB, HEADS, KV = 512, 2048, 1024, 8, 2
_PROBE = """
import json, sys, threading, time
from megatron_apriel.convert.checkpoint import hf_to_mcore
import megatron.core.dist_checkpointing, megatron.core.models.gpt  # imports are not conversion memory

def anon():
    return int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon")).split()[1]) * 1024

if __name__ == "__main__":
    base, peak, done = anon(), [0], threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon())
            time.sleep(0.002)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    hf_to_mcore(sys.argv[1], sys.argv[2], progress=False)
    done.set()
    sampler.join()
    print("RESULT", json.dumps({"anon_growth": max(peak[0], anon()) - base}))
"""


def _random_mistral(path: Path, layers: int) -> int:
    """A random fp32 Mistral-shaped HF checkpoint, one shard per layer; returns bytes per layer."""
    path.mkdir()
    g, d = torch.Generator().manual_seed(layers), HIDDEN // HEADS
    shapes = {"self_attn.q_proj.weight": (HEADS * d, HIDDEN), "self_attn.k_proj.weight": (KV * d, HIDDEN),
              "self_attn.v_proj.weight": (KV * d, HIDDEN), "self_attn.o_proj.weight": (HIDDEN, HEADS * d),
              "mlp.gate_proj.weight": (FFN, HIDDEN), "mlp.up_proj.weight": (FFN, HIDDEN),
              "mlp.down_proj.weight": (HIDDEN, FFN), "input_layernorm.weight": (HIDDEN,),
              "post_attention_layernorm.weight": (HIDDEN,)}
    weight_map = {}
    top = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g),
           "model.norm.weight": torch.ones(HIDDEN), "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=g)}
    save_file(top, path / "top.safetensors")
    weight_map.update(dict.fromkeys(top, "top.safetensors"))
    for i in range(layers):
        layer = {f"model.layers.{i}.{k}": torch.randn(s, generator=g) for k, s in shapes.items()}
        save_file(layer, path / f"layer{i}.safetensors")
        weight_map.update(dict.fromkeys(layer, f"layer{i}.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "vocab_size": VOCAB,
              "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": layers,
              "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": d, "rms_norm_eps": 1e-5,
              "rope_theta": 1e6, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(config))
    return sum(torch.Size(s).numel() for s in shapes.values()) * 4


def _anon_growth(hf: Path, out: Path) -> int:
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(hf), str(out)], capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])["anon_growth"]


def test_hf_to_mcore_resident_memory_does_not_grow_with_layers(tmp_path):
    layer_bytes = _random_mistral(tmp_path / "hf8", 8)
    _random_mistral(tmp_path / "hf16", 16)
    small = _anon_growth(tmp_path / "hf8", tmp_path / "mcore8")
    large = _anon_growth(tmp_path / "hf16", tmp_path / "mcore16")
    added = 8 * layer_bytes
    assert large - small < added / 4, (
        f"peak RssAnon of hf-to-mcore grew by {(large - small) / 1e6:.0f} MB from 8 to 16 layers "
        f"({small / 1e6:.0f} -> {large / 1e6:.0f} MB above the process before converting; the 8 added layers "
        f"hold {added / 1e6:.0f} MB): the converter keeps per-layer data resident. Check that every tensor "
        "it hands Megatron's writer is mapped from the HF files (HFReader.map_rows), not read or built.")


def _mapping_at(address: int) -> tuple[str, int]:
    """(file, offset in that file) of the memory mapping holding ``address`` (/proc/self/maps);
    the file is "" or a pseudo-name such as [heap] for anonymous memory."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return (fields[5].strip() if len(fields) > 5 else ""), int(fields[2], 16) + address - lo
    raise AssertionError(f"address {address:#x} is not mapped")


def _row_offset(path: Path, key: str, row: int) -> int:
    """Byte offset of row ``row`` of ``key`` in a safetensors file, from its header (8-byte
    little-endian header length, the JSON header, then the data); float32 tensors only."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        meta = json.loads(f.read(n))[key]
    assert meta["dtype"] == "F32"
    return 8 + n + meta["data_offsets"][0] + row * 4 * math.prod(meta["shape"][1:])


def test_map_rows_is_an_exact_zero_copy_slice_of_the_file(tmp_path):
    _random_mistral(tmp_path / "hf", 1)
    files = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    with HFReader(tmp_path / "hf") as reader:
        for key, (start, end) in {"model.layers.0.self_attn.k_proj.weight": (64, 128),
                                  "model.layers.0.input_layernorm.weight": (3, 500),
                                  "lm_head.weight": (0, VOCAB)}.items():
            rows = reader.map_rows(key, start, end)
            assert torch.equal(rows, reader.get(key)[start:end]), key
            # no copy: the first and last bytes are the file's own bytes, mapped at their offsets
            path, nbytes = str(tmp_path / "hf" / files[key]), rows.numel() * rows.element_size()
            assert _mapping_at(rows.data_ptr()) == (path, _row_offset(Path(path), key, start)), key
            assert _mapping_at(rows.data_ptr() + nbytes - 1) == (path, _row_offset(Path(path), key, end) - 1), key
            # its own storage of exactly these bytes: Megatron's writer clones views, not this
            assert rows.untyped_storage().nbytes() == nbytes, key

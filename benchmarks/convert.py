"""Conversion throughput and memory of apriel-convert on a random model built locally.

    PYTHONPATH=. python benchmarks/convert.py [--layers 8 --hidden 1024 --ffn 4096 --vocab 32000 --dtype bf16]

Prints, for hf-to-mcore and mcore-to-hf: GB/s, the ratio to reading + writing the same bytes
with safetensors alone (same shard size), and the peak RSS of the converting process (each
conversion runs in a fresh subprocess) above an idle process that imported the same modules,
relative to the largest streaming unit (one decoder layer, or embedding + output layer), split into
anonymous memory (RssAnon) and mapped file pages (RssFile, clean and reclaimable) by sampling
/proc every 5 ms, for the converting process and for the writer processes Megatron forks.
No assertions: numbers only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
_PROBE = """
import glob, json, sys, threading, time
import megatron_apriel.convert.checkpoint as c
from megatron_apriel.entrypoints.convert import main
import megatron.core.dist_checkpointing, megatron.core.models.gpt  # import time is not conversion time

def rss(pid="self"):  # MB of anonymous / file-backed resident pages
    try:
        lines = open(f"/proc/{pid}/status").read().splitlines()
    except (FileNotFoundError, ProcessLookupError):  # a writer that just exited
        return {}
    return {k: int(v.split()[0]) * 1024 for k, v in (l.split(":", 1) for l in lines) if k in ("RssAnon", "RssFile")}

def children():
    return [p for f in glob.glob("/proc/self/task/*/children") for p in open(f).read().split()]

peak = {"self": {}, "children": {}}
done = threading.Event()
def sample():  # VmHWM alone cannot tell anonymous memory from reclaimable mapped file pages
    while not done.is_set():
        for who, pids in (("self", ["self"]), ("children", children())):
            for pid in pids:
                for k, v in rss(pid).items():
                    peak[who][k] = max(peak[who].get(k, 0), v)
        time.sleep(0.005)
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
t0 = time.perf_counter()
if sys.argv[1:]:
    main(sys.argv[1:] + ["--no-progress"])
dt = time.perf_counter() - t0
done.set()
sampler.join()
# VmHWM, not ru_maxrss: ru_maxrss survives exec and would include the benchmark parent's memory
ru = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024
print("RESULT", json.dumps({"seconds": dt, "peak_rss": ru, "peak": peak["self"], "children_peak": peak["children"]}))
"""


def build_model(path: Path, layers: int, hidden: int, ffn: int, vocab: int, heads: int, kv: int,
                dtype: torch.dtype, shard_bytes: int) -> dict:
    """A random Mistral-shaped HF checkpoint; returns byte counts per streaming unit."""
    path.mkdir(parents=True)
    d = hidden // heads
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    units = {"top": sum(vocab * hidden for _ in range(2)) + hidden}
    for i in range(layers):
        p = f"model.layers.{i}."
        layer = {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                 p + "self_attn.q_proj.weight": (heads * d, hidden), p + "self_attn.k_proj.weight": (kv * d, hidden),
                 p + "self_attn.v_proj.weight": (kv * d, hidden), p + "self_attn.o_proj.weight": (hidden, heads * d),
                 p + "mlp.gate_proj.weight": (ffn, hidden), p + "mlp.up_proj.weight": (ffn, hidden),
                 p + "mlp.down_proj.weight": (hidden, ffn)}
        shapes.update(layer)
        units[f"layer{i}"] = sum(torch.Size(s).numel() for s in layer.values())
    item = torch.empty((), dtype=dtype).element_size()
    shard, shard_size, weight_map, files = {}, 0, {}, 0
    def flush():
        nonlocal shard, shard_size, files
        name = f"model-{files:05d}.safetensors"
        save_file(shard, path / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        shard, shard_size, files = {}, 0, files + 1
    for name, shape in shapes.items():
        t = (torch.randn(shape, generator=g) * 0.02).to(dtype)
        if shard and shard_size + t.numel() * item > shard_bytes:
            flush()
        shard[name] = t
        shard_size += t.numel() * item
    flush()
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "vocab_size": vocab,
           "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d, "rms_norm_eps": 1e-5,
           "rope_theta": 1e6, "sliding_window": None, "tie_word_embeddings": False, "hidden_act": "silu",
           "torch_dtype": str(dtype).removeprefix("torch.")}
    (path / "config.json").write_text(json.dumps(cfg))
    return {k: v * item for k, v in units.items()}


def safetensors_copy(src: Path, dst: Path, shard_bytes: int) -> float:
    """Seconds to read every tensor with safe_open and write them back as shards: the baseline."""
    dst.mkdir()
    t0 = time.perf_counter()
    pending, size, n = {}, 0, 0
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(f, framework="pt") as h:
            for k in h.keys():
                t = h.get_tensor(k)
                if pending and size + t.numel() * t.element_size() > shard_bytes:
                    save_file(pending, dst / f"{n}.safetensors")
                    pending, size, n = {}, 0, n + 1
                pending[k] = t
                size += t.numel() * t.element_size()
    save_file(pending, dst / f"{n}.safetensors")
    return time.perf_counter() - t0


def run_probe(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2"})
    if proc.returncode:
        raise RuntimeError(proc.stderr[-4000:])
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv", type=int, default=4)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--shard-mb", type=int, default=200)
    ap.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir, removed)")
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    work = Path(a.workdir or tempfile.mkdtemp(prefix="convert_bench_"))
    shard = a.shard_mb * 2**20
    try:
        units = build_model(work / "hf", a.layers, a.hidden, a.ffn, a.vocab, a.heads, a.kv, dtype, shard)
        total = sum(units.values())
        largest_layer = max(v for k, v in units.items() if k != "top")
        largest_unit = max(units.values())
        base = safetensors_copy(work / "hf", work / "copy", shard)
        idle = run_probe([])
        h2m = run_probe(["hf-to-mcore", "--hf", str(work / "hf"), "--out", str(work / "mcore")])
        m2h = run_probe(["mcore-to-hf", "--mcore", str(work / "mcore"), "--out", str(work / "back"),
                         "--hf-reference", str(work / "hf"), "--max-shard-gb", str(a.shard_mb / 1024)])
        gb = total / 1e9
        print(f"model: {gb:.3f} GB {a.dtype}, {a.layers} layers; largest decoder layer {largest_layer / 1e6:.1f} MB, "
              f"largest streaming unit (embedding + output) {largest_unit / 1e6:.1f} MB")
        print(f"safetensors read+write baseline: {base:.2f} s = {gb / base:.3f} GB/s")
        print(f"idle process (imports only): peak RSS {idle['peak_rss'] / 1e6:.0f} MB")
        for name, r in (("hf-to-mcore", h2m), ("mcore-to-hf", m2h)):
            extra = r["peak_rss"] - idle["peak_rss"]
            anon = r["peak"]["RssAnon"] - idle["peak"]["RssAnon"]
            kids = r["children_peak"]
            print(f"{name}: {r['seconds']:.2f} s = {gb / r['seconds']:.3f} GB/s = {base / r['seconds']:.2f}x baseline; "
                  f"peak RSS {r['peak_rss'] / 1e6:.0f} MB (+{extra / 1e6:.0f} MB over idle = "
                  f"{extra / largest_layer:.2f}x largest layer, {extra / largest_unit:.2f}x largest unit), of it "
                  f"RssAnon +{anon / 1e6:.0f} MB, RssFile peak {r['peak']['RssFile'] / 1e6:.0f} MB (idle "
                  f"{idle['peak']['RssFile'] / 1e6:.0f}); forked writers peak RssAnon "
                  f"{kids.get('RssAnon', 0) / 1e6:.0f} MB, RssFile {kids.get('RssFile', 0) / 1e6:.0f} MB "
                  "(file-backed clean pages: reclaimable page cache)")
    finally:
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

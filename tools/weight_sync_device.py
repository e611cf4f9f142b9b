"""Device-side cost of the weight-sync sender's work on one bucket, against the links it feeds.

    python tools/weight_sync_device.py                      # CUDA: a 1 GiB bf16 bucket
    python tools/weight_sync_device.py --device cpu --mb 64 # the same code on the host (a smoke run)
    python tools/weight_sync_device.py --out results.json

Times, median of ``--repeats`` after one warm-up, with the device synchronised around each:
- ``pack``: copying tensors of mixed sizes (1-8 MiB, bf16) into one packed bucket (``BucketPacker``);
- ``checksum``: sum64 over the bucket on the device (``checksum_on_device``; no host round trip);
- ``pack_checksum``: both, as the sender does for a packed bucket;
- ``checksum_direct``: sum64 over one tensor of the same size (a direct bucket: no copy at all).
Each is reported in GB/s and as a fraction of a link's time to carry the same bytes: NVLink 4
(450 GB/s per direction, H100/H200 SXM) and a 400 Gb/s NIC (50 GB/s). Below 1 the work hides
behind the transfer of the previous bucket (the sender keeps two in flight).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_apriel.weight_sync import buckets as B  # noqa: E402

LINKS_GB_S = {"nvlink4": 450.0, "nic_400gbps": 50.0}


def bucket_tensors(total_bytes: int, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """bf16 tensors of 1, 2, 4 and 8 MiB in turn, filling ``total_bytes`` (the last one trimmed)."""
    out, used, k = [], 0, 0
    g = torch.Generator(device="cpu").manual_seed(0)
    while used < total_bytes:
        nbytes = min((1 << 20) << (k % 4), total_bytes - used)
        out.append((f"t{k}", torch.randn(nbytes // 2, generator=g).to(torch.bfloat16).to(device)))
        used, k = used + nbytes, k + 1
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(device: torch.device, total_bytes: int, repeats: int) -> dict:
    tensors = bucket_tensors(total_bytes, device)
    layout = B.plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in tensors], total_bytes + B.ALIGN * len(tensors))[0]
    wire = B.new_wire_buffer(layout, device)
    direct = torch.randn(total_bytes // 2, device=device).to(torch.bfloat16)

    def pack_checksum():
        packer = B.BucketPacker(layout, wire, "sum64")
        for name, tensor in tensors:
            packer.add(name, tensor)
        return packer.finish()

    mask = (1 << 64) - 1
    value = pack_checksum()
    host = B.checksum(wire.cpu(), "sum64")
    if int(value) & mask != host or int(B.checksum_on_device(wire)) & mask != host:
        raise RuntimeError("the device checksum disagrees with the host's over the same bytes")
    seconds = {
        "pack": timed(lambda: B.pack(layout, tensors, wire), device, repeats),
        "checksum": timed(lambda: B.checksum_on_device(wire), device, repeats),
        "pack_checksum": timed(pack_checksum, device, repeats),
        "checksum_direct": timed(lambda: B.checksum_on_device(B.as_bytes(direct)), device, repeats),
    }
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = {"device": name, "bucket_mb": layout.nbytes / 1e6, "tensors": len(tensors), "seconds": seconds,
              "gb_s": {k: layout.nbytes / v / 1e9 for k, v in seconds.items()}}
    result["fraction_of_link_time"] = {
        link: {k: v / (layout.nbytes / (gb_s * 1e9)) for k, v in seconds.items()} for link, gb_s in LINKS_GB_S.items()}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--mb", type=int, default=1024, help="bucket size in MiB (1 GiB by default)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", help="also write the results as JSON here")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --device cpu for a smoke run, or on a GPU machine.")
    result = measure(device, args.mb << 20, args.repeats)
    print(f"{result['device']}: {result['tensors']} bf16 tensors, {result['bucket_mb']:.0f} MB bucket")
    for k, gb_s in result["gb_s"].items():
        fractions = ", ".join(f"{v[k]:.2f} of {link}" for link, v in result["fraction_of_link_time"].items())
        print(f"  {k:16s} {gb_s:8.1f} GB/s   ({fractions} time)")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

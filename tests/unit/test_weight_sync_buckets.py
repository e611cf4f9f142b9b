"""Bucketing, checksums and the weight-sync messages (no vLLM, no process groups)."""

import pytest
import torch

from megatron_apriel.weight_sync import buckets as B
from megatron_apriel.weight_sync.protocol import (
    PROTOCOL_VERSION, StagePlan, TransferInit, UpdateResult, parse_message, parse_version_label, version_label,
)


def _tensors():
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 3), (5,), (64, 64), (1,), (33, 2), (300, 11)]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float16, torch.bfloat16, torch.float32]
    return [(f"t{i}", torch.randn(s, generator=g).to(d)) for i, (s, d) in enumerate(zip(shapes, dtypes))]


@pytest.mark.parametrize("bucket_bytes", [64, 200, 4096, 1 << 20])
@pytest.mark.parametrize("algo", ["crc32", "sum64"])
def test_pack_unpack_roundtrip(bucket_bytes, algo):
    tensors = _tensors()
    layouts = B.plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in tensors], bucket_bytes)
    assert [s.name for b in layouts for s in b.tensors] == [n for n, _ in tensors]
    it = iter(tensors)
    out = []
    for layout in layouts:
        wire = B.new_wire_buffer(layout)
        B.pack(layout, [next(it) for _ in layout.tensors], wire)
        B.seal(wire, algo)
        ok, _, _ = B.verify(wire, algo)
        assert ok
        for slot in layout.tensors:
            assert slot.offset % B.ALIGN == 0
        out.extend(B.unpack(layout, wire))
    for (n1, t1), (n2, t2) in zip(tensors, out, strict=True):
        assert n1 == n2 and t1.dtype == t2.dtype and torch.equal(t1, t2)


def _block_crossing_tensors():
    """Tensors that straddle sum64's 1 MiB blocks, some non-contiguous (transposed, strided)."""
    g = torch.Generator().manual_seed(1)
    big = torch.randn(700, 1000, generator=g)
    return [("a", torch.randn(3, generator=g)), ("b", big.t()), ("c", torch.randn(300_001, generator=g)),
            ("d", big[:, ::2].to(torch.bfloat16)), ("e", torch.randn(5, 7, generator=g).t().to(torch.float16)),
            ("f", torch.randn(1 << 18, generator=g))]


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 3 << 20, 16 << 20])
@pytest.mark.parametrize("algo", ["crc32", "sum64"])
def test_fused_pack_seal_equals_pack_then_seal(bucket_bytes, algo):
    tensors = _block_crossing_tensors()
    layouts = B.plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in tensors], bucket_bytes)
    it = iter(tensors)
    out = []
    for layout in layouts:
        chunk = [next(it) for _ in layout.tensors]
        fused, plain = B.new_wire_buffer(layout).fill_(0xAB), B.new_wire_buffer(layout).fill_(0xCD)
        value = B.pack_sealed(layout, chunk, fused, algo)
        B.pack(layout, chunk, plain)
        assert value == B.seal(plain, algo) and torch.equal(fused, plain) and B.verify(fused, algo)[0]
        out.extend(B.unpack(layout, fused))
    for (n1, t1), (n2, t2) in zip(tensors, out, strict=True):
        assert n1 == n2 and torch.equal(t1, t2)


def test_buckets_respect_size_and_oversized_tensor_gets_its_own():
    """Float32 tensors of 40, 160, 4000, 40, 40 and 400 bytes into 512-byte buckets, 64-byte aligned,
    worked by hand: a@0 b@64 (224 used); big would start at 256 and overflow: a bucket of its own;
    c@0 d@64 (104 used); e would end at 128 + 400 = 528 > 512: it opens the last bucket."""
    sizes = {"a": 10, "b": 40, "big": 1000, "c": 10, "d": 10, "e": 100}
    layouts = B.plan_buckets([(n, torch.float32, (k,)) for n, k in sizes.items()], 512)
    assert [[(s.name, s.offset) for s in b.tensors] for b in layouts] == [
        [("a", 0), ("b", 64)], [("big", 0)], [("c", 0), ("d", 64)], [("e", 0)]]
    assert [b.nbytes for b in layouts] == [256, 4032, 128, 448]
    shared = [b for b in layouts if len(b.tensors) > 1]
    assert len(shared) == 2 and all(b.nbytes <= 512 for b in shared)


@pytest.mark.parametrize("algo", ["crc32", "sum64"])
@pytest.mark.parametrize("position", [0, 1, 4097, -1])
def test_any_flipped_bit_is_detected(algo, position):
    wire = torch.randint(0, 256, ((1 << 22) + 64 + B.TRAILER,), dtype=torch.uint8)
    B.seal(wire, algo)
    body = B.payload(wire)
    for bit in (0, 7):
        body[position] ^= 1 << bit
        assert not B.verify(wire, algo)[0]
        body[position] ^= 1 << bit
    assert B.verify(wire, algo)[0]


def test_sum64_detects_blocks_swapped_and_matches_torch_path():
    words = torch.arange(2 * (1 << 17) + 5, dtype=torch.int64)
    swapped = torch.cat([words[1 << 17: 2 << 17], words[: 1 << 17], words[2 << 17:]])
    assert B.checksum(words.view(torch.uint8), "sum64") != B.checksum(swapped.view(torch.uint8), "sum64")
    meta_free = words.view(torch.uint8)
    assert B.checksum(meta_free, "sum64") == B._checksum_torch(meta_free)


def test_pack_refuses_data_that_disagrees_with_plan():
    layout = B.plan_buckets([("a", torch.float32, (4,))], 1024)[0]
    with pytest.raises(ValueError, match="plan and data disagree"):
        B.pack(layout, [("a", torch.zeros(5))], B.new_wire_buffer(layout))
    with pytest.raises(ValueError, match="plan and data disagree"):
        B.pack_sealed(layout, [("a", torch.zeros(4, dtype=torch.float16))], B.new_wire_buffer(layout), "sum64")


def test_messages_roundtrip_and_refuse_other_protocol_versions():
    layouts = B.plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in _tensors()], 256)
    plan = StagePlan(version=3, stage=1, num_stages=2, checksum="crc32", buckets=layouts)
    again = parse_message(plan.model_dump_json())
    assert again == plan and again.tensor_names() == [f"t{i}" for i in range(6)]
    init = TransferInit(backend="gloo", stages=[{"host": "127.0.0.1", "port": 29555}], world_size=2, rank_offset=1)
    assert parse_message(init.model_dump()) == init
    with pytest.raises(ValueError, match="protocol_version"):
        UpdateResult(version=1, accepted=True, protocol_version=PROTOCOL_VERSION + 1)
    with pytest.raises(ValueError):
        StagePlan(version=0, stage=2, num_stages=2, checksum="crc32", buckets=[])
    with pytest.raises(ValueError):
        parse_message({"kind": "nope"})


def test_version_labels():
    assert parse_version_label(version_label(12)) == 12
    assert parse_version_label("default") == 0
    with pytest.raises(ValueError):
        parse_version_label("step-3")

"""Bucketing, checksums and the weight-sync messages (no vLLM, no process groups)."""

import pytest
import torch

from megatron_apriel.records.weights import (
    PROTOCOL_VERSION,
    BucketLayout,
    StagePlan,
    TransferInit,
    UpdateResult,
    parse_message,
    parse_version_label,
    version_label,
)
from megatron_apriel.weight_sync import buckets as B


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
        chunk = [next(it) for _ in layout.tensors]
        B.pack(layout, chunk, wire)
        assert B.pack_summed(layout, chunk, B.new_wire_buffer(layout), algo) == B.checksum(wire, algo)
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
        value = B.pack_summed(layout, chunk, fused, algo)
        B.pack(layout, chunk, plain)
        assert value == B.checksum(plain, algo) and torch.equal(fused, plain)
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


def test_direct_buckets_hold_large_tensors_and_buckets_go_in_order_of_their_last_tensor():
    """Float32 sizes in bytes, 512-byte packed buckets, direct from 1000 bytes, worked by hand.
    Case 1: a(40) big(4000) b(160) huge(8000) c(40): a@0 b@64 c@256 share one packed bucket whose
    last tensor (c) comes after both direct ones, so it is sent last.
    Case 2: a(40) b(400) big(4000) c(400): c does not fit after b (512 + 400 > 512), so [a, b]
    is complete before big is drawn, and [c] after."""
    one = B.plan_buckets([(n, torch.float32, (k,)) for n, k in
                          {"a": 10, "big": 1000, "b": 40, "huge": 2000, "c": 10}.items()], 512, direct_bytes=1000)
    assert [([(s.name, s.offset) for s in b.tensors], b.direct, b.nbytes) for b in one] == [
        ([("big", 0)], True, 4000), ([("huge", 0)], True, 8000), ([("a", 0), ("b", 64), ("c", 256)], False, 320)]
    two = B.plan_buckets([(n, torch.float32, (k,)) for n, k in {"a": 10, "b": 100, "big": 1000, "c": 100}.items()],
                         512, direct_bytes=1000)
    assert [[s.name for s in b.tensors] for b in two] == [["a", "b"], ["big"], ["c"]]
    assert [b.index for b in two] == [0, 1, 2] and [b.direct for b in two] == [False, True, False]
    odd = B.plan_buckets([("w", torch.bfloat16, (3, 333))], 512, direct_bytes=1000)[0]
    assert odd.direct and odd.nbytes == 1998  # exact size: nothing pads a tensor sent from its own memory
    assert all(not b.direct for b in B.plan_buckets([("x", torch.float32, (10_000,))], 512))  # default: none


@pytest.mark.parametrize("algo", ["crc32", "sum64"])
@pytest.mark.parametrize("length", [(1 << 22) + 64, (1 << 20) + 3])  # a packed bucket; a direct bf16 tensor's odd size
@pytest.mark.parametrize("position", [0, 1, 4097, -1])
def test_any_flipped_bit_is_detected(algo, length, position):
    data = torch.randint(0, 256, (length,), dtype=torch.uint8)
    good = B.checksum(data, algo)
    for bit in (0, 7):
        data[position] ^= 1 << bit
        assert B.checksum(data, algo) != good
        data[position] ^= 1 << bit
    assert B.checksum(data, algo) == good


@pytest.mark.parametrize("length", [0, 5, 8, 4096 + 7, (1 << 20) * 2, (1 << 20) * 2 + 8, (1 << 20) * 3 + 5])
def test_sum64_on_device_path_matches_host_path(length):
    """The device path (torch, wrapping int64, no host round trip) gives the host path's bits,
    block boundaries and a partial last word included; high words make every sum wrap."""
    data = torch.randint(0, 256, (length,), dtype=torch.uint8)
    data[7::8] = 0xFF
    device_value = B.checksum_on_device(data)
    assert device_value.dtype == torch.int64 and device_value.dim() == 0
    assert int(device_value) & ((1 << 64) - 1) == B.checksum(data, "sum64")
    table = B.checksum_table([device_value, B.checksum_on_device(data[:3])])
    assert B.table_values(table) == [B.checksum(data, "sum64"), B.checksum(data[:3], "sum64")]
    assert B.table_values(B.checksum_table([B.checksum(data, "sum64")])) == [B.checksum(data, "sum64")]


def test_sum64_detects_blocks_swapped():
    words = torch.arange(2 * (1 << 17) + 5, dtype=torch.int64)
    swapped = torch.cat([words[1 << 17: 2 << 17], words[: 1 << 17], words[2 << 17:]])
    assert B.checksum(words.view(torch.uint8), "sum64") != B.checksum(swapped.view(torch.uint8), "sum64")


def test_pack_refuses_data_that_disagrees_with_plan():
    layout = B.plan_buckets([("a", torch.float32, (4,))], 1024)[0]
    with pytest.raises(ValueError, match="plan and data disagree"):
        B.pack(layout, [("a", torch.zeros(5))], B.new_wire_buffer(layout))
    with pytest.raises(ValueError, match="plan and data disagree"):
        B.pack_summed(layout, [("a", torch.zeros(4, dtype=torch.float16))], B.new_wire_buffer(layout), "sum64")
    with pytest.raises(ValueError, match="got 0 of 1 tensors"):
        B.pack(layout, [], B.new_wire_buffer(layout))


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
    slot = {"name": "w", "dtype": "float32", "shape": [4], "offset": 0, "nbytes": 16}
    assert BucketLayout(index=0, nbytes=16, direct=True, tensors=[slot]).direct
    for bad in ({"nbytes": 64}, {"tensors": [slot, {**slot, "name": "v", "offset": 16}], "nbytes": 32}):
        with pytest.raises(ValueError, match="direct bucket holds exactly one tensor"):
            BucketLayout(**{"index": 0, "nbytes": 16, "direct": True, "tensors": [slot], **bad})


def test_version_labels():
    assert parse_version_label(version_label(12)) == 12
    assert parse_version_label("default") == 0
    with pytest.raises(ValueError):
        parse_version_label("step-3")

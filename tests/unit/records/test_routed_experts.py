"""Routed experts from the server's answer to the trainer's sample (no vLLM): vLLM's wire format
(base64 ``.npy``), the rollout record (schema 5, schemas 1 to 4 still read), the stream, and the
rows the trainer replays (sparse layers only, the last token unrouted)."""

import asyncio
import base64
import io

import numpy as np
import pytest

from megatron_apriel.fleet.client import FleetClient
from megatron_apriel.fleet.config import SamplingConfig
from megatron_apriel.records.rollouts import RolloutGroup, RoutedExperts, routing_rows
from megatron_apriel.records.stream import StreamReader, StreamWriter
from megatron_apriel.testing.fake_fleet import FakeFleet
from tests.unit.records.test_stream import group, snap


def _npy_b64(ids: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, ids, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def test_the_client_decodes_vllms_field_per_choice():
    fleet = FakeFleet(routed_experts=(3, 2, 8))

    async def go():
        client = FleetClient(["http://fake"], transport=fleet.transport())
        try:
            return await client.generate(list(b"What is 1 + 2?"), SamplingConfig(max_tokens=64), n=2)
        finally:
            await client.aclose()

    for c in asyncio.run(go()):
        ids = c.routed_experts.array()
        assert c.routed_experts.shape == ids.shape == (len(c.prompt_token_ids) + len(c.token_ids) - 1, 3, 2)
        assert ids.dtype == np.uint8 and ids.max() < 8


def test_the_servers_field_is_kept_verbatim_when_narrow_and_narrowed_once_when_not():
    ids = np.random.default_rng(0).integers(0, 128, (9, 3, 2))
    narrow = _npy_b64(ids.astype(np.uint8))
    kept = RoutedExperts.from_npy_base64(narrow)
    assert kept.data == narrow and kept.shape == (9, 3, 2) and np.array_equal(kept.array(), ids)
    for wide, want in ((np.int64, "uint8"), (np.int32, "uint8")):
        r = RoutedExperts.from_npy_base64(_npy_b64(ids.astype(wide)))
        assert r.dtype == want and r.array().dtype == np.dtype(want) and np.array_equal(r.array(), ids)
    many = RoutedExperts.from_npy_base64(_npy_b64((ids * 3).astype(np.int32)))  # ids up to 381: two bytes
    assert many.dtype == "uint16" and np.array_equal(many.array(), ids * 3)
    fortran = RoutedExperts.from_npy_base64(_npy_b64(np.asfortranarray(ids.astype(np.uint8))))
    assert np.array_equal(fortran.array(), ids) and fortran.array().flags.c_contiguous
    with pytest.raises(ValueError, match="expert ids"):
        RoutedExperts.from_npy_base64(_npy_b64(-ids.astype(np.int32) - 1))
    with pytest.raises(ValueError, match="not a base64 .npy"):
        RoutedExperts.from_npy_base64(base64.b64encode(ids.astype(np.uint8).tobytes()).decode())


def _with_routing(g: RolloutGroup, rows: int, layers: int = 3, k: int = 2, dtype=np.uint8) -> RolloutGroup:
    rng = np.random.default_rng(0)
    rollouts = [r.model_copy(update={"routed_experts": RoutedExperts.from_array(
        rng.integers(0, 200, (rows, layers, k)).astype(dtype))}) for r in g.rollouts]
    return RolloutGroup.model_validate(g.model_copy(update={"rollouts": rollouts}).model_dump())


def test_records_keep_the_ids_exactly_through_the_stream(tmp_path):
    g = _with_routing(group(0), rows=3 + 5 - 1)  # a prompt of 3, a completion of 5
    writer = StreamWriter(tmp_path)
    writer.append([g], snap(1))
    back = StreamReader(tmp_path).next_group()
    for a, b in zip(g.rollouts, back.rollouts):
        assert b.routed_experts.shape == (7, 3, 2) \
            and np.array_equal(a.routed_experts.array(), b.routed_experts.array())
    assert back.schema_version == 5
    wide = RoutedExperts.from_array(np.full((2, 1, 1), 300, dtype=np.uint16))  # more than 256 experts
    assert wide.dtype == "uint16" and wide.array().tolist() == [[[300]], [[300]]]


def test_records_refuse_ids_that_do_not_fit_the_sequence():
    with pytest.raises(ValueError, match="prompt \\+ completion - 1"):
        _with_routing(group(0), rows=3 + 5)
    with pytest.raises(ValueError, match="does not hold"):
        RoutedExperts(shape=(2, 2, 2), dtype="uint8", data=base64.b64encode(b"1234567").decode())
    whole = RoutedExperts.from_array(np.zeros((4, 2, 2), dtype=np.uint8))
    for shape in ((3, 2, 2), (5, 2, 2)):  # one row short or over: the length tells, undecoded
        with pytest.raises(ValueError, match="does not hold"):
            RoutedExperts(shape=shape, dtype="uint8", data=whole.data)
    with pytest.raises(ValueError, match="does not hold"):
        RoutedExperts(shape=(4, 2, 2), dtype="uint16", data=whole.data)
    with pytest.raises(ValueError, match="uint8/uint16"):
        RoutedExperts.from_array(np.zeros((2, 2, 2), dtype=np.int32))
    old = group(0).model_dump()  # schema 2 streams (no routed experts) are still read
    old["schema_version"] = 2
    assert RolloutGroup.model_validate(old).rollouts[0].routed_experts is None


@pytest.mark.parametrize("extra", [3, 6, -3, -6])
def test_records_refuse_a_payload_longer_or_shorter_by_whole_base64_blocks(extra):
    """Bytes added or cut in multiples of 3 keep base64's padding as it was: only the length tells."""
    ids = np.zeros((4, 2, 2), dtype=np.uint8)
    buf = io.BytesIO()
    np.save(buf, ids, allow_pickle=False)
    raw = buf.getvalue()
    changed = raw + bytes(extra) if extra > 0 else raw[:extra]
    data = base64.b64encode(changed).decode()
    assert data.count("=") == base64.b64encode(raw).decode().count("=")  # the padding matches
    with pytest.raises(ValueError, match="does not hold"):
        RoutedExperts(shape=(4, 2, 2), dtype="uint8", data=data)
    assert RoutedExperts(shape=(4, 2, 2), dtype="uint8", data=base64.b64encode(raw).decode())  # the whole one is kept


def test_samples_carry_the_sparse_layers_and_leave_the_last_token_unrouted():
    g = _with_routing(group(0), rows=7, layers=3)
    ids = g.rollouts[0].routed_experts.array()
    s = g.train_sample(0, version=0, moe_layers=[0, 2])
    assert s.routing.shape == (8, 2, 2) and s.routing.dtype == np.int16
    assert np.array_equal(s.routing[:7], ids[:, [0, 2]]) and (s.routing[7] == -1).all()
    assert g.train_sample(0, version=0).routing is None  # a dense model takes none
    assert np.array_equal(routing_rows(ids, [1])[:7, 0], ids[:, 1])


def test_replay_without_recorded_experts_names_the_server_flag():
    with pytest.raises(ValueError, match="--return-routed-experts"):
        group(0).train_sample(0, version=0, moe_layers=[0], need_routing=True)
    assert group(0).train_sample(0, version=0, moe_layers=[0]).routing is None  # measured only if recorded

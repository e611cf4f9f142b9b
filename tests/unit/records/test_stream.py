"""The durable rollout stream: atomic segments, torn writes, cursors, validation on read."""

import multiprocessing
import os
import signal
import time

import pytest

from megatron_apriel.records.rollouts import GroupTimings, Rollout, RolloutGroup, VersionSpan
from megatron_apriel.records.stream import (
    ActorSnapshot,
    PendingGroup,
    StreamReader,
    StreamWriter,
    TrainerProgress,
    list_segments,
    read_progress,
    segment_path,
    write_progress,
)


def group(i: int, n_tokens: int = 5, version: int = 0) -> RolloutGroup:
    rollouts = [Rollout(completion_ids=[i, j, 7, 8, 9][:n_tokens], logprobs=[-0.25 * (j + 1)] * n_tokens,
                        versions=[VersionSpan(version=version, start=0, end=n_tokens)], finish_reason="stop",
                        outcome="correct", score=1.0, success=True, reward=1.0 - j, advantage=0.5 - j)
                for j in range(2)]
    return RolloutGroup(seq=-1, problem_id=f"p{i}", domain="math", prompt_ids=[1, 2, i], rollouts=rollouts,
                        admitted_version=version, timings=GroupTimings(submitted_at=1.0, generate_s=0.1, verify_s=0.2))


def snap(next_seq: int, in_flight=()) -> ActorSnapshot:
    return ActorSnapshot(next_seq=next_seq, sampler={"counts": {"math": next_seq}}, order={"pos": next_seq},
                         in_flight=[PendingGroup(problem_id=p, domain="math", admitted_version=0) for p in in_flight])


def write(writer: StreamWriter, ids: list[int], in_flight=()) -> list[RolloutGroup]:
    return writer.append([group(i) for i in ids], snap(writer.next_seq + len(ids), in_flight))


def test_round_trip_is_exact_and_numbered(tmp_path):
    writer = StreamWriter(tmp_path)
    written = write(writer, [0, 1, 2]) + write(writer, [3]) + write(writer, [4, 5])
    assert [g.seq for g in written] == [0, 1, 2, 3, 4, 5]
    assert list_segments(tmp_path) == [0, 3, 4]
    got = StreamReader(tmp_path).read_all()
    assert got == written  # token ids and float32 log-probs survive the base64 encoding bit for bit
    assert got[2].rollouts[1].logprobs.tolist() == [-0.5] * 5 and got[2].prompt_ids.tolist() == [1, 2, 2]


def test_cursor_resumes_anywhere_with_nothing_lost_or_repeated(tmp_path):
    writer = StreamWriter(tmp_path)
    for chunk in ([0, 1, 2], [3], [4, 5, 6, 7], [8, 9]):
        write(writer, chunk)
    everything = [g.seq for g in StreamReader(tmp_path).read_all()]
    for cursor in range(0, 11):
        first = StreamReader(tmp_path, cursor=0)
        head = [first.next_group().seq for _ in range(cursor)]
        resumed = StreamReader(tmp_path, cursor=first.cursor)  # as a trainer restarted from its checkpoint
        assert head + [g.seq for g in resumed.read_all()] == everything


def test_reader_sees_segments_as_they_appear(tmp_path):
    writer = StreamWriter(tmp_path)
    reader = StreamReader(tmp_path)
    assert reader.next_group() is None
    write(writer, [0])
    assert reader.next_group().seq == 0 and reader.next_group() is None
    write(writer, [1, 2])
    assert [g.seq for g in reader.read_all()] == [1, 2]


def test_writer_continues_numbering_and_keeps_the_snapshot(tmp_path):
    write(StreamWriter(tmp_path), [0, 1], in_flight=["p7"])
    again = StreamWriter(tmp_path)  # a restarted actor
    assert again.next_seq == 2 and again.last_snapshot().in_flight[0].problem_id == "p7"
    assert [g.seq for g in write(again, [2])] == [2]


def _write_forever(root):
    writer = StreamWriter(root)
    big = [group(i) for i in range(200)]  # a segment large enough that the kill lands mid-write
    while True:
        writer.append(big, snap(writer.next_seq + len(big)))


def test_a_writer_killed_mid_segment_leaves_a_readable_stream(tmp_path):
    ctx = multiprocessing.get_context("fork")
    for attempt in range(3):
        proc = ctx.Process(target=_write_forever, args=(tmp_path,))
        proc.start()
        time.sleep(0.4 + 0.13 * attempt)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        groups = StreamReader(tmp_path).read_all()
        assert [g.seq for g in groups] == list(range(len(groups)))
        assert len(groups) == StreamWriter(tmp_path).next_seq  # which also removes the torn temporary file
    assert not list(tmp_path.glob(".seg_*"))


def test_a_torn_temporary_file_is_ignored_and_cleaned_up(tmp_path):
    write(StreamWriter(tmp_path), [0, 1])
    whole = segment_path(tmp_path, 0).read_bytes()
    torn = tmp_path / ".seg_000000000002.json.tmp-999"  # what a writer killed mid-write leaves
    torn.write_bytes(whole[: len(whole) // 2])
    reader = StreamReader(tmp_path)
    assert [g.seq for g in reader.read_all()] == [0, 1] and reader.next_group() is None
    writer = StreamWriter(tmp_path)
    assert not torn.exists() and writer.next_seq == 2
    assert [g.seq for g in write(writer, [2])] == [2] and reader.next_group().seq == 2


def test_damaged_or_foreign_segments_are_refused(tmp_path):
    write(StreamWriter(tmp_path), [0, 1])
    path = segment_path(tmp_path, 0)
    path.write_text(path.read_text().replace('"stream_version":1', '"stream_version":9'))
    with pytest.raises(ValueError, match="stream_version 9"):
        StreamReader(tmp_path).next_group()
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a valid rollout segment"):
        StreamReader(tmp_path).next_group()


def test_records_validate_their_invariants():
    with pytest.raises(ValueError, match="log-probs"):
        Rollout(completion_ids=[1, 2], logprobs=[-1.0], versions=[], finish_reason="stop", outcome="wrong",
                score=0.0, success=False, reward=0.0, advantage=0.0)
    with pytest.raises(ValueError, match="do not cover"):
        Rollout(completion_ids=[1, 2], logprobs=[-1.0, -1.0], versions=[VersionSpan(version=0, start=0, end=1)],
                finish_reason="stop", outcome="wrong", score=0.0, success=False, reward=0.0, advantage=0.0)
    with pytest.raises(ValueError, match="schema"):
        RolloutGroup.model_validate({**group(0).model_dump(), "schema_version": 6})
    # a stream written before rollouts kept the verifier's note (schema 1) is still read
    old = group(0).model_dump()
    old["schema_version"] = 1
    for r in old["rollouts"]:
        del r["detail"]
    assert RolloutGroup.model_validate(old).rollouts[0].detail == ""


def test_train_samples_mark_the_tokens_of_the_trained_version():
    g = group(0)
    spans = [VersionSpan(version=3, start=0, end=2), VersionSpan(version=4, start=2, end=5)]
    r = g.rollouts[0].model_copy(update={"versions": spans})
    g = g.model_copy(update={"rollouts": [r, g.rollouts[1]]})
    s4, s3 = g.train_samples(version=4), g.train_samples(version=3)
    assert s4[0].tokens.tolist() == [1, 2, 0] + [0, 0, 7, 8, 9] and s4[0].prompt_len == 3 and s4[0].advantage == 0.5
    assert s4[0].fresh_start == 2 and s3[0].fresh_start == 0 and g.train_samples(version=5)[0].fresh_start == 5
    assert g.min_version == 0  # the second rollout was sampled by version 0


def test_progress_round_trip(tmp_path):
    assert read_progress(tmp_path) is None
    p = TrainerProgress(step=3, filled=2, cursor=17, version=3)
    write_progress(tmp_path, p)
    assert read_progress(tmp_path) == p

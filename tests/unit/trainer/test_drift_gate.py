"""The drift gate's parts, each real: the judgement over windows, the retirement of a server through
the run directory (a real apriel-serve watcher stopping a real process), the stream source counting or
dropping the tripped server's earlier groups, and the fleet client taking the server out."""

import asyncio
import json
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest

from megatron_apriel.entrypoints.serve import _register_when_healthy
from megatron_apriel.fleet.client import FleetClient
from megatron_apriel.fleet.config import DriftGateConfig, SamplingConfig
from megatron_apriel.fleet.registry import register, registered, retire, retire_request
from megatron_apriel.parallel.rendezvous import free_port
from megatron_apriel.records.config import RolloutConfig
from megatron_apriel.records.stream import StreamWriter
from megatron_apriel.trainer.drift_gate import DriftGate, FleetGate, per_server
from megatron_apriel.trainer.stream_source import StreamSource
from tests.unit.records.test_stream import group, snap
from tests.unit.trainer.test_stream_source import ctx  # noqa: F401  (the fixture)

CFG = DriftGateConfig(enabled=True, max_drift=0.05, window_tokens=500)


def figures(**servers) -> dict:
    """A step's per-server metrics: name=(mean drift, fresh tokens); names a_1 -> host a:1."""
    out = {}
    for name, (drift, tokens) in servers.items():
        key = name.replace("_", ":")
        out[f"mismatch/server/{key}/fresh_abs_log_rho"] = drift
        out[f"mismatch/server/{key}/fresh_tokens"] = tokens
    return out


def test_the_figures_are_read_back_per_server():
    assert per_server(figures(a_1=(0.2, 10), b_2=(0.0, 3)) | {"train/loss": 1.0}) == {"a:1": (0.2, 10, 0.0, 0.0),
                                                                                          "b:2": (0.0, 3, 0.0, 0.0)}
    assert per_server(routed(a_1=(0.2, 10, 0.5, 20))) == {"a:1": (0.2, 10, 0.5, 20)}


def test_a_window_is_judged_once_full_on_the_token_weighted_mean():
    gate = DriftGate(CFG)
    assert gate.observe(figures(a_1=(0.2, 300)), version=3) == []  # 300 < 500 tokens: not judged yet
    # (0.2 x 300 + 0.001 x 300) / 600 = 0.1005 > 0.05: trips, named with the step's version
    (trip,) = gate.observe(figures(a_1=(0.001, 300)), version=4)
    assert (trip.server, trip.version, trip.tokens) == ("a:1", 4, 600) and trip.drift == pytest.approx(0.1005)
    assert gate.observe(figures(a_1=(0.2, 499)), version=5) == []  # a new window began after the judgement


def test_a_server_exactly_at_the_threshold_passes_and_a_pass_clears_a_trip():
    gate = DriftGate(CFG)
    assert gate.observe(figures(a_1=(0.05, 500)), version=0) == []
    assert len(gate.observe(figures(a_1=(0.06, 500)), version=1)) == 1 and gate.tripped == {"a:1"}
    gate.observe(figures(a_1=(0.01, 500)), version=2)  # its restarted instance passes
    assert gate.tripped == set()


def test_the_run_stops_only_once_every_server_seen_has_tripped():
    gate = DriftGate(CFG)
    gate.observe(figures(a_1=(0.3, 500), b_2=(0.001, 500)), version=0)
    assert gate.tripped == {"a:1"} and not gate.every_server_tripped
    gate.observe(figures(b_2=(0.3, 500)), version=1)
    assert gate.every_server_tripped


def routed(**servers) -> dict:
    """A MoE step's per-server metrics: name=(mean drift, fresh tokens, routing mismatch, compared pairs)."""
    out = figures(**{name: figs[:2] for name, figs in servers.items()})
    for name, (_, _, share, pairs) in servers.items():
        out[f"mismatch/server/{name.replace('_', ':')}/routing_mismatch"] = share
        out[f"mismatch/server/{name.replace('_', ':')}/routing_compared"] = pairs
    return out


ROUTED = DriftGateConfig(enabled=True, max_drift=0.05, window_tokens=500, max_routing_mismatch=0.1)


def test_a_moe_server_trips_on_its_routing_mismatch_over_the_window():
    gate = DriftGate(ROUTED)
    assert gate.observe(routed(a_1=(0.001, 300, 0.3, 600)), version=2) == []
    # routing over the window (0.3 x 600 + 0 x 600) / 1200 = 0.15 > 0.1; drift 0.001 is fine
    (trip,) = gate.observe(routed(a_1=(0.001, 300, 0.0, 600), b_2=(0.001, 600, 0.05, 1200)), version=3)
    assert (trip.server, trip.pairs, trip.tokens) == ("a:1", 1200, 600) and trip.routing == pytest.approx(0.15)
    said = trip.describe(ROUTED)
    assert "max_routing_mismatch=0.1" in said and "max_drift" not in said and gate.tripped == {"a:1"}


def test_routing_exactly_at_the_threshold_passes_and_unset_is_not_judged():
    assert DriftGate(ROUTED).observe(routed(a_1=(0.001, 500, 0.1, 1000)), version=0) == []
    assert DriftGate(CFG).observe(routed(a_1=(0.001, 500, 0.9, 1000)), version=0) == []  # max_routing_mismatch null
    assert DriftGate(ROUTED).observe(figures(a_1=(0.001, 500)), version=0) == []  # a dense server: no routing


def test_bad_gate_settings_are_refused_naming_the_key():
    with pytest.raises(ValueError, match="max_routing_mismatch=1.5"):
        DriftGateConfig(max_routing_mismatch=1.5)
    with pytest.raises(ValueError, match="max_drift"):
        DriftGateConfig(max_drift=0)
    with pytest.raises(ValueError, match="before_trip"):
        DriftGateConfig(before_trip="keep")


def test_a_retired_server_leaves_the_registry_and_its_watcher_stops_it(tmp_path):
    """A real apriel-serve registration watcher (the double-forked helper) over a stand-in server: a
    static HTTP server that answers /health, and a sleeping process in the server's place."""
    www = tmp_path / "www"
    www.mkdir()
    (www / "health").write_text("ok")
    port = free_port()
    health = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                               "--directory", str(www)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = subprocess.Popen(["sleep", "300"])
    fleet = tmp_path / "fleet"
    try:
        _register_when_healthy(str(fleet), f"http://127.0.0.1:{port}", server.pid, poll_s=0.05)
        deadline = time.monotonic() + 60
        while not registered(fleet):
            assert time.monotonic() < deadline, "the watcher never registered the server"
            time.sleep(0.05)
        (reg,) = registered(fleet)
        assert server.poll() is None and retire_request(fleet, reg.instance) is None
        retire(fleet, reg, "drift gate: test")
        assert registered(fleet) == [] and retire_request(fleet, reg.instance) == "drift gate: test"
        assert server.wait(timeout=60) == -15  # SIGTERM from the watcher
    finally:
        for p in (health, server):
            p.kill()
            p.wait()


def tripped_stream(root):
    """Four groups: from server a at versions 1 and 2, from b at 2, from a at 3 (its restarted instance)."""
    writer = StreamWriter(root)
    for version, server in [(1, "http://a:1"), (2, "http://a:1"), (2, "http://b:2"), (3, "http://a:1")]:
        g = group(writer.next_seq, version=version)
        g = g.model_copy(update={"rollouts": [r.model_copy(update={"server": server}) for r in g.rollouts]})
        writer.append([g], snap(writer.next_seq + 1))


@pytest.mark.parametrize("drop", [False, True])
def test_the_tripped_servers_earlier_groups_are_counted_and_dropped_if_asked(tmp_path, ctx, drop):  # noqa: F811
    tripped_stream(tmp_path)
    cfg = RolloutConfig(group_size=2, groups_per_step=4 if not drop else 2, max_lag=None)
    source = StreamSource(tmp_path, cfg, ctx, {"math": 1.0})
    source.server_tripped("a:1", version=2, drop=drop)  # tripped on its version-2 tokens
    samples, m = source.next_batch(3)
    assert m["rollout/groups_from_tripped"] == 2  # a's groups at versions 1 and 2; not its version-3 one
    trained = sorted((s.server, int(s.lags[0])) for s in samples)  # (server, lag at step 3), per rollout
    kept = [("http://a:1", 0)] * 2 + [("http://b:2", 1)] * 2  # a's restarted instance and b
    assert trained == (kept if drop else sorted(kept + [("http://a:1", 2)] * 2 + [("http://a:1", 1)] * 2))
    again = StreamSource(tmp_path, cfg, ctx, {"math": 1.0})
    again.load_state_dict(source.state_dict())
    assert again.trips == [("a:1", 2)] and again.drop_tripped == drop


def test_a_server_removed_while_requests_wait_on_its_version_question_sends_them_elsewhere():
    """Requests wait for a server that serves the required version while server a's /weight_info is
    slow; a is removed meanwhile (retired by the gate): the waiting requests complete on b, none fails,
    and no request goes to a afterwards."""
    asked_a, a_removed, served = asyncio.Event(), asyncio.Event(), []

    async def handler(request):
        if request.url.path == "/weight_info":
            if request.url.host == "a":
                asked_a.set()
                await a_removed.wait()  # answers only once it is out of the fleet
                return httpx.Response(200, json={"weight_version": "1"})
            await asked_a.wait()  # b answers after a was asked: the requests are waiting on a's answer
            await a_removed.wait()
            return httpx.Response(200, json={"weight_version": "1"})
        served.append(request.url.host)
        return httpx.Response(200, json={"choices": [{"index": 0, "finish_reason": "length", "token_ids": [1],
                                                      "weight_versions": [{"version": "1", "start": 0, "end": 1}],
                                                      "logprobs": {"content": [{"token_id": 1, "logprob": -0.5}]}}]})

    async def go():
        client = FleetClient(["http://a", "http://b"], cooldown_s=0.01, transport=httpx.MockTransport(handler))
        client.required_version = 1
        try:
            waiting = asyncio.gather(*(client.generate([1], SamplingConfig()) for _ in range(8)))
            await asked_a.wait()
            client.remove_server("http://a/")
            client.remove_server("http://c")  # not in the fleet: nothing changes
            a_removed.set()
            return await waiting, [s.url for s in client.servers]
        finally:
            await client.aclose()

    done, left = asyncio.run(go())
    assert len(done) == 8 and left == ["http://b"] and set(served) == {"b"}


def test_register_writes_what_retire_removes(tmp_path):
    reg = register(tmp_path, "http://h:5", pid=1, host="h")
    other = register(tmp_path, "http://h:6", pid=2, host="h")
    retire(tmp_path, reg, "why")
    assert registered(tmp_path) == [other] and retire_request(tmp_path, other.instance) is None


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_drift_that_is_no_number_trips_and_says_why(bad):
    """A server whose log-probs give NaN (or inf) drift is the one to take out: ``nan > max`` is False."""
    (trip,) = DriftGate(CFG).observe(figures(a_1=(bad, 500)), version=1)
    assert trip.server == "a:1" and "max_drift=0.05" in trip.describe(CFG)
    (trip,) = DriftGate(ROUTED).observe(routed(a_1=(0.001, 500, bad, 1000)), version=1)
    assert "max_routing_mismatch=0.1" in trip.describe(ROUTED) and "max_drift" not in trip.describe(ROUTED)


class _Source:
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _trainer(tmp_path, gate):
    from megatron_apriel.trainer.config import CheckpointConfig, LossConfig, TrainerConfig
    from megatron_apriel.trainer.trainer import ModelParts, Trainer

    return Trainer(trainer=TrainerConfig(), loss=LossConfig(), checkpoint=CheckpointConfig(), checkpoints=tmp_path,
                   init_hf=None, ctx=SimpleNamespace(rank=0), parts=ModelParts(None, [], None, None),
                   source=_Source(), logger=None, stop=SimpleNamespace(), gate=gate)


def test_the_gates_seen_and_tripped_servers_are_saved_with_the_checkpoint_and_restored(tmp_path, monkeypatch):
    """A run that stopped because every server tripped resumes knowing it; a checkpoint saved
    before the gate's state was kept (no "gate" in state.json) still loads."""
    import megatron_apriel.trainer.drift_gate as drift_gate
    import megatron_apriel.trainer.trainer as trainer_mod

    state_json: dict = {}

    def save(root, step, *, extra, **_):
        state_json.clear()
        state_json.update(json.loads(json.dumps({"step": step, **extra})))  # as state.json holds it
        return tmp_path

    monkeypatch.setattr(drift_gate, "from_the_one_rank", lambda obj: obj)  # one rank: it is the judge
    monkeypatch.setattr(trainer_mod, "save_checkpoint", save)
    monkeypatch.setattr(trainer_mod, "latest_checkpoint", lambda root: tmp_path if state_json else None)
    monkeypatch.setattr(trainer_mod, "load_checkpoint", lambda path, **_: state_json)
    first = _trainer(tmp_path, FleetGate(CFG, tmp_path / "fleet", is_logging_rank=True))
    first.gate.gate.observe(figures(a_1=(0.3, 500), b_2=(0.001, 500), c_3=(0.001, 100)), version=0)
    first.gate.gate.observe(figures(b_2=(0.3, 500)), version=1)
    first.save()
    resumed = _trainer(tmp_path, FleetGate(CFG, tmp_path / "fleet", is_logging_rank=True))
    assert resumed.gate.gate.seen == {"a:1", "b:2", "c:3"} and resumed.gate.gate.tripped == {"a:1", "b:2"}
    assert resumed.gate.gate.window == {}  # c's window under way is not saved
    resumed.gate.gate.observe(figures(c_3=(0.3, 500)), version=2)
    assert resumed.gate.gate.every_server_tripped
    del state_json["gate"]
    older = _trainer(tmp_path, FleetGate(CFG, tmp_path / "fleet", is_logging_rank=True))
    assert older.step == 0 and older.gate.gate.tripped == set()

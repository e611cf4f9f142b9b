"""vLLM's counters around each weight update: parsed from Prometheus text as vLLM exposes it (one
series per engine, ``_total`` samples, ``_created`` gauges beside them), differenced from one
update's pause to the next, a restarted server (its counters start again) left out."""

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from megatron_apriel.weight_sync.control import WeightSyncControl
from megatron_apriel.weight_sync.engine_counters import EngineCounters, FleetReadings, parse_counters


def exposition(preempted: dict[str, float], prompt: float, generated: float) -> str:
    """/metrics text with vLLM's counter names, per engine, and series we do not read."""
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    preemptions = Counter("vllm:num_preemptions", "preemptions", labels, registry=registry)
    for engine, n in preempted.items():
        preemptions.labels("tiny", engine).inc(n)
    Counter("vllm:prompt_tokens", "prefill", labels, registry=registry).labels("tiny", "0").inc(prompt)
    Counter("vllm:generation_tokens", "decode", labels, registry=registry).labels("tiny", "0").inc(generated)
    Counter("vllm:request_success", "done", labels, registry=registry).labels("tiny", "0").inc(99)
    Histogram("vllm:e2e_request_latency_seconds", "latency", labels, registry=registry).labels("tiny", "0").observe(2)
    return generate_latest(registry).decode()


def test_counters_are_summed_over_engines_and_other_series_ignored():
    c = parse_counters(exposition({"0": 3, "1": 4}, prompt=120, generated=45))
    assert c == EngineCounters(preempted=7, prompt_tokens=120, generation_tokens=45)
    assert parse_counters("# nothing exported yet\n") == EngineCounters(0, 0, 0)
    with pytest.raises(ValueError):
        parse_counters("vllm:num_preemptions_total{engine=\"0\" 3\n")


def test_each_window_is_the_difference_from_the_previous_pause_over_servers_read_both_times():
    readings = FleetReadings()
    a0, b0 = EngineCounters(1, 100, 50), EngineCounters(0, 10, 5)
    assert readings.window({"a": a0, "b": b0}, at=10.0) is None  # the first update has no previous reading
    w = readings.window({"a": EngineCounters(5, 160, 90), "b": EngineCounters(2, 30, 25)}, at=12.5)
    assert (w.seconds, w.servers) == (2.5, 2)
    assert (w.preempted, w.prompt_tokens, w.generation_tokens) == (4 + 2, 60 + 20, 40 + 20)
    # b restarted (its counters fell), c is new: only a's difference counts
    w = readings.window({"a": EngineCounters(6, 170, 100), "b": EngineCounters(0, 3, 1), "c": EngineCounters(9, 9, 9)},
                        at=14.0)
    assert (w.servers, w.preempted, w.prompt_tokens, w.generation_tokens) == (1, 1, 10, 10)
    assert readings.window({"d": EngineCounters(0, 0, 0)}, at=15.0) is None  # no server read twice


def test_the_control_reads_every_servers_metrics_and_leaves_out_one_that_gives_none(caplog):
    texts = {"a": exposition({"0": 2}, 10, 20), "b": exposition({"0": 5}, 1, 2)}

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.method == "GET" and request.url.path == "/metrics"
        if request.url.host in texts:
            return httpx.Response(200, text=texts[request.url.host])
        return httpx.Response(404, text="Not Found")  # c: no /metrics route (the figures are not control)

    control = WeightSyncControl(["http://a:1", "http://b:2", "http://c:3"])
    control._http = httpx.Client(transport=httpx.MockTransport(handler))  # the HTTP seam; the rest is real
    try:
        counters = control.collect_counters(control.request_counters())
    finally:
        control.close()
    assert counters == {"http://a:1": EngineCounters(2, 10, 20), "http://b:2": EngineCounters(5, 1, 2)}
    assert "http://c:3/metrics" in caplog.text and "404" in caplog.text

"""The control plane's pause under each KV policy: ``/pause?mode=keep`` always (running requests are
frozen, never aborted), with ``clear_cache=true`` under ``fleet.kv_on_update=recompute`` (vLLM then
computes every running request's prefix again with the new weights) and ``false`` under ``keep``."""

import httpx
import pytest

from megatron_apriel.weight_sync.control import WeightSyncControl


@pytest.mark.parametrize("keep, clear", [(False, "true"), (True, "false")])
def test_pause_asks_each_server_to_keep_its_requests_and_clears_their_cache_unless_keep(keep, clear):
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, request.url.path, dict(request.url.params)))
        return httpx.Response(200, json={"status": "paused"})

    control = WeightSyncControl(["http://a:1", "http://b:2"], keep_kv=keep)
    control._http = httpx.Client(transport=httpx.MockTransport(handler))  # the HTTP seam; the rest is real
    try:
        control.pause()
    finally:
        control.close()
    assert sorted(seen) == [(h, "/pause", {"mode": "keep", "clear_cache": clear}) for h in ("a", "b")]

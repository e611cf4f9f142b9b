"""Which servers the trainer's weight broadcast keeps: a busy server (it took the connection, its
answer came too late) stays in the fleet it is connected to for a grace; a dead one (connection
refused) goes at once."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_apriel.parallel.rendezvous import free_port
from megatron_apriel.weight_sync.control import Probe, probe_versions
from megatron_apriel.weight_sync.sender import BUSY_GRACE_S, live_members


class _Server(BaseHTTPRequestHandler):
    """/weight_info answers version 4, after the release event when the server is made busy."""

    release: threading.Event

    def do_GET(self):
        self.release.wait(30)
        body = b'{"weight_version": "4"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def servers():
    """A server that answers, one that is busy (answers only once released), and a port nobody listens on."""
    up, busy = threading.Event(), threading.Event()
    up.set()
    started = []
    for release in (up, busy):
        handler = type("Handler", (_Server,), {"release": release})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
    urls = [f"http://127.0.0.1:{s.server_port}" for s in started] + [f"http://127.0.0.1:{free_port()}"]
    yield urls
    busy.set()
    for s in started:
        s.shutdown()


def test_a_probe_tells_a_busy_server_from_a_dead_one(servers):
    up, busy, dead = servers
    probes = probe_versions(servers, timeout_s=0.5)
    assert probes == {up: Probe(version=4), busy: Probe(busy=True), dead: Probe()}


def test_a_busy_member_stays_connected_and_a_new_busy_one_waits_until_it_answers():
    members = [("http://a", "1"), ("http://b", "1"), ("http://c", "1")]
    probes = {"http://a": Probe(version=3), "http://b": Probe(busy=True), "http://c": Probe()}
    busy = {"http://b": 5.0}
    assert live_members(members, probes, members, busy) == members[:2]  # b kept: the fleet does not flap
    assert live_members(members, probes, [], busy) == members[:1]  # b joins once it answers
    restarted = [("http://a", "1"), ("http://b", "2")]  # b came back as a new instance: a new member
    assert live_members(restarted, {"http://a": Probe(version=3), "http://b": Probe(busy=True)}, members[:2],
                        busy) == restarted[:1]
    # busy for the whole grace (a stopped process takes connections and never answers): left out
    assert live_members(members, probes, members, {"http://b": BUSY_GRACE_S - 0.1}) == members[:2]
    assert live_members(members, probes, members, {"http://b": BUSY_GRACE_S}) == members[:1]

"""`free_port` draws below the ephemeral range (where no outgoing connection's local port can take
the port before the server binds it) and never returns a port that is bound."""

import random
import socket

from megatron_apriel.parallel.rendezvous import ephemeral_range, free_port


def test_a_free_port_is_below_the_ephemeral_range_and_bindable():
    low, _ = ephemeral_range()
    for _ in range(20):
        port = free_port()
        assert 1024 < port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_bound_port_is_drawn_again():
    first = random.Random(7).randint(20000, 32767)  # what a Random(7) draws first
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", first))
        busy.listen()
        assert free_port(random.Random(7)) != first

import socket


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (tests and benchmarks only)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

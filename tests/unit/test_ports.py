"""The test servers' ports: outside the kernel's ephemeral range, which outgoing connections draw
their source ports from (a port picked there can be taken before the child server binds it), free,
and never the same twice in one process."""
from __future__ import annotations

import socket

from tests.ports import ephemeral_range, free_port


def test_ports_lie_outside_the_ephemeral_range_are_free_and_never_repeat():
    low, high = ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(not low <= port <= high for port in ports)
    for port in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_or_given_before_is_not_given(monkeypatch):
    import tests.ports

    given = free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        # the first candidates drawn: the port in use and the one given, then the real draw
        real, first = tests.ports.random.randrange, [taken, given, taken, given]
        monkeypatch.setattr(tests.ports.random, "randrange", lambda a, b: first.pop() if first else real(a, b))
        assert free_port() not in (taken, given) and not first

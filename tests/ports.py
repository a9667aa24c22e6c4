"""Loopback ports for the servers the tests start.

A port that `bind(0)` hands out comes from the kernel's ephemeral range, the range it also draws
the source ports of outgoing connections from. Between the test picking such a port and a child
server binding it (seconds, while the child imports), any connection the tests or other servers
open (a gateway dials its service, clients dial servers) may take it as its source port, and the
child fails with "Address already in use". These ports come from below that range instead, which
the kernel never assigns on its own, and none is handed out twice in one test process.
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 10000
_given: set[int] = set()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for source ports (Linux's default where it cannot be read)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A loopback TCP port below the ephemeral range, free now, not given before in this process."""
    low, high = ephemeral_range()
    # below the range, or above it where it starts too low to leave room
    bottom, top = (_LOWEST, low) if low >= _LOWEST + 1000 else (high + 1, 65536)
    for _ in range(1000):
        port = random.randrange(bottom, top)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free loopback port in [{bottom}, {top})")

"""A TCP port for a test server to bind later, chosen where nothing else takes ports by itself, and the port an
asyncio server listens on.

A port from `bind(("127.0.0.1", 0))` comes from the kernel's ephemeral range, which every outgoing connection on the
machine also draws from (the other pytest worker's p2pd dials loopback all the time): between the choice and a
server's bind seconds later, a connection may take it. So the port is drawn below the ephemeral range, from a band
of its own per pytest-xdist worker, and checked bindable. A port is handed out once per process: a test asking for
several (a chain's servers, a server and its metrics) binds none of them before it has them all, so a port checked
free and closed again could otherwise come back for the next ask (1 in 6,000 a pair)."""

from __future__ import annotations

import asyncio
import os
import random
import socket

_LOW, _HIGH = 20000, 32000  # below Linux's default ephemeral range (32768-60999)
_handed_out: set[int] = set()  # every port free_port returned in this process


def _band() -> tuple[int, int]:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    width = (_HIGH - _LOW) // count
    start = _LOW + (index % count) * width
    return start, start + width


def free_port() -> int:
    """A loopback TCP port that is free now and outside the ephemeral range (RuntimeError if none is found)."""
    low, high = _band()
    for port in random.sample(range(low, high), min(200, high - low)):
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free TCP port in {low}-{high}")


def listening_port(server: asyncio.Server) -> int:
    """The port `server` (started on port 0) listens on."""
    return int(server.sockets[0].getsockname()[1])

"""How another terminal reaches a swarm run in a network namespace that has only `lo` (the loopback-only tool,
`unshare -n`). Imports nothing heavy, so a probe process can call it cheaply."""

from __future__ import annotations

import os
import socket


def namespace_hint(pid: int | None = None) -> str | None:
    """How to reach the swarm from another terminal when this process runs in a network namespace that has only
    `lo` (the loopback-only tool, `unshare -n`): its 127.0.0.1 is not the other terminal's. None otherwise."""
    try:
        interfaces = sorted(name for _, name in socket.if_nameindex())  # this namespace's (not /sys's) interfaces
    except OSError:
        return None
    if interfaces != ["lo"]:
        return None
    pid = os.getpid() if pid is None else pid
    enter = (
        f"nsenter --net=/proc/{pid}/ns/net --"
        if os.geteuid() == 0
        else f"nsenter --target {pid} --user --net --preserve-credentials --"
    )
    return (
        "This demo runs in a network namespace with only loopback (e.g. under loopback-only): 127.0.0.1 above is "
        "its own. From another terminal, run the commands and URLs above inside it:\n"
        f"  {enter} corolla-generate ...   /   {enter} curl http://127.0.0.1:PORT/..."
    )

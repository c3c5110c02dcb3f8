"""A client process exits promptly even when its DHT process does not stop gracefully: the DHT process ignores
SIGTERM (so that a server can still announce OFFLINE after a process-group SIGTERM), and multiprocessing's exit hook
only sends SIGTERM and then joins it forever. Seen as `corolla-generate` hanging after Ctrl-C on a loaded machine,
where the graceful shutdown outlasted hivemind's 3-second grace period."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from corolla.swarm.dht import SwarmConfig, create_dht, get_visible_maddrs, shutdown_dht

EXIT_LIMIT_S = 25.0  # the grace period (3-5 s) plus the kill, a loaded CI machine's margin; a hang is forever

# the client's DHT process never finishes its graceful shutdown (as under heavy load)
CLIENT = textwrap.dedent(
    """
    import asyncio, os, sys
    from corolla.swarm import dht as dht_module

    async def _stalled_shutdown(self):
        await asyncio.sleep(3600)

    dht_module.OrphanProofDHT._shutdown = _stalled_shutdown  # inherited by the forked DHT process
    from corolla.client.config import ClientConfig
    from corolla.client.routing.sequence_manager import RemoteSequenceManager

    manager = RemoteSequenceManager(ClientConfig(initial_peers=(sys.argv[1],)), ["exit-test.0"])
    manager.wait_ready(30)
    import time
    print(f"dht_pid={manager.dht.pid} at={time.time()}", flush=True)
    if sys.argv[2] == "shutdown":
        manager.shutdown()
    """
)


@pytest.fixture(scope="module")
def bootstrap_maddr():
    node = create_dht(SwarmConfig(startup_timeout_s=20))
    try:
        yield get_visible_maddrs(node, timeout_s=10)[0]
    finally:
        shutdown_dht(node)


@pytest.mark.parametrize("how", ["shutdown", "no_shutdown"])
def test_client_exits_though_its_dht_process_ignores_the_graceful_shutdown(bootstrap_maddr: str, how: str):
    # "shutdown": the client's shutdown path (what Ctrl-C on corolla-generate runs); "no_shutdown": the interpreter
    # exits with the DHT process still up (the exit hook kills it)
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENT, bootstrap_maddr, how],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=EXIT_LIMIT_S + 90)  # start-up (imports, the DHT) is not the bound
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"the client process hung at exit ({how}):\n{err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    exited_at = time.time()
    fields = dict(item.split("=") for item in out.split())
    exit_s = exited_at - float(fields["at"])
    print(f"{how}: exited {exit_s:.1f} s after its DHT was up")
    assert exit_s < EXIT_LIMIT_S, err[-3000:]
    assert not _alive(int(fields["dht_pid"])), "the DHT process outlived its owner"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().split(")")[-1].split()[0] != "Z"

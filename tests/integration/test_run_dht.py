"""`corolla-dht` as users run it: it prints its address, a second node bootstraps from it, and neither SIGTERM nor
SIGKILL leaves its DHT process or p2pd behind. Also: a SIGKILLed owner of `create_dht` leaves nothing."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from corolla.cli.run_dht import build_parser, config_from_args
from corolla.swarm.dht import SwarmConfig, create_dht, get_peer_id, run_in_dht, shutdown_dht
from corolla.swarm.local import DHT_PEER_PREFIX

START_TIMEOUT_S = 60.0  # generous: four processes import torch at once on a loaded 2-core machine
EXIT_TIMEOUT_S = 10.0


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[-1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                tree.setdefault(int(fields[1]), []).append(int(entry.name))
    return tree


def descendants(pid: int) -> set[int]:
    tree, found, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(pid)
    return out


def wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(pids)


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


class Proc:
    """A child process whose stdout lines are read by a thread, so every wait can be bounded."""

    def __init__(self, *args: str):
        self.popen = subprocess.Popen(
            [sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.popen.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_for_lines(self, prefix: str, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        found: list[str] = []
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1 if found else max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                if found:
                    return found
                continue
            self.seen.append(line)
            if line.startswith(prefix):
                found.append(line[len(prefix) :])
        if not found:
            raise AssertionError(f"no line starting with {prefix!r} within {timeout_s} s; output: {self.seen[-20:]}")
        return found

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(EXIT_TIMEOUT_S)


OWNER_SCRIPT = """
import threading, time
from corolla.swarm.dht import SwarmConfig, create_dht
holder = {}
def make():
    holder["dht"] = create_dht(SwarmConfig(startup_timeout_s=20))
t = threading.Thread(target=make); t.start(); t.join()
print("owner: ready", holder["dht"].pid, flush=True)
time.sleep(60)
"""


@pytest.fixture(scope="module")
def procs():
    """All processes of this module, launched together (each pays ~5 s of imports; in parallel they overlap)."""
    started = {
        "dht_sigterm": Proc("-m", "corolla.cli.run_dht", "--refresh_period", "0.5"),
        "dht_sigkill": Proc("-m", "corolla.cli.run_dht", "--refresh_period", "0.5"),
        "owner_in_thread": Proc("-c", OWNER_SCRIPT),
    }
    yield started
    for proc in started.values():
        proc.kill()


def start_dht_node(proc: Proc) -> tuple[Proc, list[str], set[int]]:
    maddrs = proc.wait_for_lines(DHT_PEER_PREFIX, START_TIMEOUT_S)
    family = descendants(proc.popen.pid)
    assert any(comm(pid) == "p2pd" for pid in family), "the DHT's p2pd should run under corolla-dht"
    return proc, maddrs, family


def test_corolla_dht_bootstraps_a_second_node_and_stops_on_sigterm(procs):
    proc, maddrs, family = start_dht_node(procs["dht_sigterm"])
    assert all(m.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in m for m in maddrs)

    node = create_dht(SwarmConfig(initial_peers=maddrs, startup_timeout_s=20))
    try:
        assert run_in_dht(node, _routing_table_size, timeout_s=10, what="routing table") >= 1
        # corolla DHT nodes store only dictionary values (subkeys), as Petals writes them: a plain value could wipe a
        # whole block key or the model index (see swarm/signed_records)
        assert node.store("k", "v", expiration_time=time.time() + 30, subkey="s", return_future=True).result(10)
        assert not node.store("k2", "v", expiration_time=time.time() + 30, return_future=True).result(10)
        assert get_peer_id(node) is not None
    finally:
        shutdown_dht(node)

    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(EXIT_TIMEOUT_S) == 0
    assert not wait_gone(family, EXIT_TIMEOUT_S), "DHT process or p2pd survived SIGTERM"


async def _routing_table_size(_dht, node) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


def test_corolla_dht_sigkill_leaves_nothing(procs):
    proc, _, family = start_dht_node(procs["dht_sigkill"])
    proc.popen.kill()
    proc.popen.wait(EXIT_TIMEOUT_S)
    assert not wait_gone(family, EXIT_TIMEOUT_S), "DHT process or p2pd survived SIGKILL of corolla-dht"


def test_sigkilled_owner_leaves_no_dht_or_p2pd(procs):
    # corolla-dht above covers a DHT created from the main thread (parent-death signal); this owner creates it
    # from a short-lived thread, where only the watchdog can notice the owner's death
    proc = procs["owner_in_thread"]
    (dht_pid,) = proc.wait_for_lines("owner: ready ", START_TIMEOUT_S)
    family = descendants(proc.popen.pid)
    assert int(dht_pid) in family and any(comm(pid) == "p2pd" for pid in family)
    os.kill(proc.popen.pid, signal.SIGKILL)
    proc.popen.wait(EXIT_TIMEOUT_S)
    assert not wait_gone(family, EXIT_TIMEOUT_S), f"survivors: {[comm(p) for p in alive(family)]}"


def test_help_documents_loopback_default_and_reference_flags():
    text = build_parser().format_help()
    for flag in ("--initial_peers", "--host_maddrs", "--announce_maddrs", "--identity_path", "--refresh_period"):
        assert flag in text
    assert "127.0.0.1" in text and "--no_relay" in text and "--use_auto_relay" in text
    args = build_parser().parse_args(["--initial_peers", "/ip4/127.0.0.1/tcp/1/p2p/QmX"])
    config = config_from_args(args)
    assert not config.is_public and config.dht_kwargs()["host_maddrs"] == ["/ip4/127.0.0.1/tcp/0"]
    assert config.dht_kwargs()["nat_port_map"] is False and config.dht_kwargs()["use_relay"] is False


def test_leak_finder_sees_a_stray_p2pd(leak_finder, tmp_path):
    fake = tmp_path / "p2pd"
    fake.symlink_to("/bin/sleep")
    stray = subprocess.Popen([str(fake), "30"])
    try:
        run_id = os.environ["COROLLA_TEST_RUN_ID"]
        assert stray.pid in leak_finder(run_id)
    finally:
        stray.kill()
        stray.wait(EXIT_TIMEOUT_S)
    assert stray.pid not in leak_finder(run_id)

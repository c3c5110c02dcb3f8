"""Where a many-users round's CPU time goes, per process and per thread (the many-users bench's breakdown).

`CpuProbe` samples, in the bench (device) process: the runtime thread, the serving loop thread and the handler
channels' reader (and writer) threads (`corolla-channel-*`, each thread's own CPU clock, `time.pthread_getcpuclockid`), the rest of this process, the handler processes and this process's
p2pd daemon (utime + stime from `/proc/<pid>/stat`; Linux). Client processes time themselves (`client_cpu`) because they may have exited
by the time the bench samples again. Nothing here runs on the serving path: the bench samples before the common
start and after the last result."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from corolla.utils.logging import get_logger

logger = get_logger(__name__)

RUNTIME_THREAD = "device runtime thread"
LOOP_THREAD = "device serving loop thread"
CHANNEL_THREADS = "device channel threads"
DEVICE_OTHER = "device process, other threads"
HANDLERS = "handler processes"
SERVER_P2PD = "server p2pd"
CLIENTS = "client processes"
CLIENT_P2PD = "client p2pds"


def _thread_cpu_s(thread: threading.Thread) -> float:
    if thread.ident is None or not thread.is_alive():
        return 0.0
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def process_stat(pid: int) -> tuple[str, int, float] | None:
    """(name, parent pid, CPU seconds: utime + stime) of a live process, from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    name = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()  # from field 3 (state) on
    return name, int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def _process_cpu_s(pid: int) -> float:
    stat = process_stat(pid)
    return stat[2] if stat is not None else 0.0


def _p2pd_children_cpu_s(parent: int) -> float:
    """CPU seconds of `parent`'s direct p2pd children (the server's daemon, or a client's own)."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = process_stat(int(entry))
            if stat is not None and stat[0] == "p2pd" and stat[1] == parent:
                total += stat[2]
    return total


@dataclass(frozen=True)
class CpuSample:
    """CPU seconds so far per part (see the module's names) and the wall clock when taken."""

    seconds: dict[str, float]
    wall_s: float

    def since(self, earlier: CpuSample) -> dict[str, float]:
        return {k: v - earlier.seconds.get(k, 0.0) for k, v in self.seconds.items()}


class CpuProbe:
    """Samples the device process's threads and the server-side processes (see the module docstring)."""

    def __init__(self, runtime_thread: threading.Thread | None, loop_thread: threading.Thread, handler_pids: list[int]):
        self.runtime_thread, self.loop_thread, self.handler_pids = runtime_thread, loop_thread, handler_pids

    def sample(self) -> CpuSample:
        runtime_s = _thread_cpu_s(self.runtime_thread) if self.runtime_thread is not None else 0.0
        loop_s = _thread_cpu_s(self.loop_thread)
        channels_s = sum(_thread_cpu_s(t) for t in threading.enumerate() if t.name.startswith("corolla-channel-"))
        times = os.times()
        seconds = {
            RUNTIME_THREAD: runtime_s,
            LOOP_THREAD: loop_s,
            CHANNEL_THREADS: channels_s,
            DEVICE_OTHER: times.user + times.system - runtime_s - loop_s - channels_s,
            HANDLERS: sum(_process_cpu_s(p) for p in self.handler_pids),
            SERVER_P2PD: _p2pd_children_cpu_s(os.getpid()),
        }
        return CpuSample(seconds, time.monotonic())


def client_cpu() -> tuple[float, float]:
    """(this client process's CPU seconds, all its threads, its p2pd children's CPU seconds) so far. Either client
    kind (`users.clients`) is covered: a petals-kind session's hivemind writer task and a corolla-kind session's
    socket writes run in this process, and both talk to the p2pd this process started (a socket session to none)."""
    return time.process_time(), _p2pd_children_cpu_s(os.getpid())


def per_step_us(cpu_s: dict[str, float], steps: int) -> dict[str, float]:
    """CPU microseconds per decode step (all sessions' steps of the window) for each part."""
    return {k: round(v / steps * 1e6, 1) for k, v in cpu_s.items()} if steps > 0 else {}


def with_clients_per_step_us(server_s: dict[str, float], collected: list[dict], steps: int) -> dict[str, float]:
    """`per_step_us` of the server side's parts and of the client processes and their p2pd daemons, as each client
    process reported its own (`cpu_s`: process, daemon)."""
    cpu = dict(server_s)
    cpu[CLIENTS] = sum(r.get("cpu_s", (0.0, 0.0))[0] for r in collected)
    cpu[CLIENT_P2PD] = sum(r.get("cpu_s", (0.0, 0.0))[1] for r in collected)
    return per_step_us(cpu, steps)

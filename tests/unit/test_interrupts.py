"""Ctrl-C ends the client's blocking waits even when the kernel hands the SIGINT to another thread than the main one
(then CPython only flags it, and a main thread blocked in an untimed wait never looks). Each case runs in a child
process whose side thread receives the SIGINT (or SIGTERM: `signal.pthread_kill`), as a hivemind or torch thread
may."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

NOTICE_LIMIT_S = 5.0  # WAIT_SLICE_S is 0.25 s; a wait that never looks hangs until the child is killed

PRELUDE = textwrap.dedent(
    """
    import signal, sys, threading, time

    def interrupt_from_a_side_thread(after_s):
        def _send():
            time.sleep(after_s)
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # handled in this thread, flagged for main
        threading.Thread(target=_send, daemon=True).start()

    def report(wait):
        interrupt_from_a_side_thread(0.5)
        started = time.monotonic()
        try:
            wait()
        except KeyboardInterrupt:
            print(f"interrupted after {time.monotonic() - started:.2f} s", flush=True)
        else:
            print("returned", flush=True)
    """
)

CASES = {
    # a step waiting on the client loop (missing blocks: retried forever); the call is cancelled with the wait
    "background_loop": """
        import asyncio
        from corolla.client import background_loop
        cancelled = threading.Event()
        async def forever():
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise
        report(lambda: background_loop.run(forever()))
        print("call cancelled" if cancelled.wait(5) else "call still running", flush=True)
    """,
    # a step in this thread on a socket stream whose server does not answer
    "socket_exchange": """
        import socket
        from hivemind.proto import runtime_pb2
        from corolla.client.transport.local_transport import LocalInferenceStream
        ours, server = socket.socketpair()
        ours.setblocking(False)
        stream = LocalInferenceStream(ours, "QmSilentServer")
        report(lambda: stream.exchange(runtime_pb2.ExpertRequest(uid="x"), timeout_s=600))
    """,
    # corolla-server's loop in the main thread, stopped by its SIGTERM handler (`Server.request_stop`); the loop has
    # no timer that would wake it
    "server_loop": """
        import asyncio
        from corolla.utils import busy_poll
        loop_and_event = []
        def request_stop(*_):
            loop, event = loop_and_event
            loop.call_soon_threadsafe(event.set)
        signal.signal(signal.SIGTERM, request_stop)
        async def serve():
            loop_and_event.extend([asyncio.get_running_loop(), asyncio.Event()])
            threading.Thread(target=lambda: (time.sleep(0.5), signal.pthread_kill(threading.get_ident(), signal.SIGTERM)), daemon=True).start()
            started = time.monotonic()
            await loop_and_event[1].wait()
            print(f"interrupted after {time.monotonic() - started:.2f} s", flush=True)
        busy_poll.run(serve(), busy_poll.BusyPollSelector())
    """,
    # waiting for the first view of the swarm (and corolla-dht's, the demo's waits)
    "event_wait": """
        from corolla.utils.interrupts import event_wait
        report(lambda: event_wait(threading.Event(), 600))
    """,
}


# reached only when the case ran through: the child's interpreter teardown (torch's: seconds of CPU) is not under test
POSTLUDE = """
import os
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.parametrize("case", sorted(CASES))
def test_ctrl_c_delivered_to_another_thread_ends_the_wait(case: str):
    code = PRELUDE + textwrap.dedent(CASES[case]) + POSTLUDE
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case}: the wait ignored Ctrl-C")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines and lines[0].startswith("interrupted after "), done.stdout + done.stderr[-2000:]
    assert float(lines[0].split()[2]) < NOTICE_LIMIT_S, lines[0]
    if case == "background_loop":
        assert lines[1] == "call cancelled", lines

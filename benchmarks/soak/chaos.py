"""The chaos side of the churn soak: replica slots per span of a `LocalSwarm`, a seeded schedule that SIGKILLs or
SIGTERMs a ready server (the last ready replica of a span only now and then: an outage), restarts stopped replicas
after a random delay, and counts what happened (and whatever went wrong: crashes, slow exits, processes that
outlived a SIGKILL). Runs in the caller's (main) thread, so servers get their parent-death signal."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from corolla.swarm.local import LocalSwarm, ServerProcess
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


class ChaosSettings(Protocol):
    """The fields of `ChurnConfig` the chaos loop reads (as properties: a protocol's plain attribute must be
    settable, and the config is a frozen dataclass)."""

    @property
    def model_path(self) -> Path: ...

    @property
    def duration_s(self) -> float: ...

    @property
    def replicas_per_span(self) -> int: ...

    @property
    def chaos_min_interval_s(self) -> float: ...

    @property
    def chaos_max_interval_s(self) -> float: ...

    @property
    def sigkill_share(self) -> float: ...

    @property
    def outage_probability(self) -> float: ...

    @property
    def force_outage(self) -> bool: ...

    @property
    def restart_min_delay_s(self) -> float: ...

    @property
    def restart_max_delay_s(self) -> float: ...

    @property
    def server_ready_timeout_s(self) -> float: ...

    @property
    def stop_grace_s(self) -> float: ...

    @property
    def kill_reap_s(self) -> float: ...


@dataclass
class ChaosCounters:
    """What the chaos loop did and saw; `outage_s` sums, over spans, the time with no ready replica."""

    kills: int = 0
    terms: int = 0
    restarts: int = 0
    outages: int = 0
    outage_s: float = 0.0
    skipped: int = 0  # actions with no eligible victim
    crashes: int = 0  # servers that exited without being signalled
    slow_exits: int = 0  # SIGTERMed servers still running after stop_grace_s (then SIGKILLed)
    kill_leftovers: int = 0  # stopped servers whose group (DHT process, p2pd) outlived them by kill_reap_s
    startup_failures: int = 0  # (re)started servers not ready within server_ready_timeout_s
    events: list[str] = field(default_factory=list)  # "t=12.3 SIGKILL server 0:2 r1 (outage)", ...


@dataclass
class _Slot:
    """One replica of one span: its current server process (None before the first start) and what we did to it."""

    span: tuple[int, int]
    replica: int
    process: ServerProcess | None = None
    generation: int = 0
    signalled: str = ""  # "", "SIGKILL" or "SIGTERM"
    signalled_at: float = 0.0
    started_at: float = 0.0
    restart_at: float | None = None  # when a stopped replica is started again
    outage: bool = False  # stopped as part of an outage: restart after the shortest delay

    def alive(self) -> bool:
        return self.process is not None and self.process.proc.poll() is None

    def ready(self) -> bool:
        """Serving: alive, not signalled, and it printed its ready line."""
        return self.alive() and not self.signalled and bool(self.process and self.process.ready_lines())


class ChaosLoop:
    """`start(swarm, spans)`, `wait_all_ready()`, `begin()`, then `tick()` every ~0.1 s from the thread that called
    `start`."""

    def __init__(
        self,
        config: ChaosSettings,
        rng: random.Random,
        launch_args: Callable[[str, str | None], Sequence[str]] | None = None,
    ):
        self.config = config
        # extra flags for each launch (its WAN proxy), by the server's name and that of the one it replaces
        self.launch_args = launch_args
        self.rng = rng
        self.counters = ChaosCounters()
        self.slots: list[_Slot] = []
        self.swarm: LocalSwarm | None = None
        self._t0 = time.monotonic()
        self._next_action_at = 0.0
        self._chaos_started_at: float | None = None
        self._last_tick = time.monotonic()
        self._span_down: dict[tuple[int, int], bool] = {}

    # ---------------------------------------------------------------------------------------------- set-up

    def start(self, swarm: LocalSwarm, spans: Sequence[tuple[int, int]]) -> None:
        """Starts every replica of every span (without waiting)."""
        self.swarm = swarm
        self.slots = [_Slot(span, r) for span in spans for r in range(self.config.replicas_per_span)]
        for slot in self.slots:
            self._launch(slot)

    def wait_all_ready(self, timeout_s: float) -> None:
        """Waits (bounded) until every replica is ready; TimeoutError / RuntimeError from the first that is not."""
        deadline = time.monotonic() + timeout_s
        for slot in self.slots:
            assert slot.process is not None
            slot.process.wait_ready(max(0.0, deadline - time.monotonic()))

    def begin(self) -> None:
        """Time zero of the chaos: the first action comes after a random interval."""
        self._t0 = self._last_tick = time.monotonic()
        self._schedule_next_action()

    def _launch(self, slot: _Slot) -> None:
        assert self.swarm is not None
        name = f"server{slot.span[0]}-{slot.span[1]}r{slot.replica}g{slot.generation}"
        previous = slot.process.name if slot.process is not None else None
        args = self.launch_args(name, previous) if self.launch_args is not None else ()
        slot.process = self.swarm.start_server(
            self.config.model_path, *args, block_indices=slot.span, name=name, wait=False
        )
        slot.generation += 1
        slot.signalled, slot.restart_at, slot.started_at, slot.outage = "", None, time.monotonic(), False

    def _event(self, text: str) -> None:
        line = f"t={time.monotonic() - self._t0:.1f} {text}"
        self.counters.events.append(line)
        logger.info(f"churn.chaos({line})")

    def _schedule_next_action(self) -> None:
        c = self.config
        self._next_action_at = time.monotonic() + self.rng.uniform(c.chaos_min_interval_s, c.chaos_max_interval_s)

    # ------------------------------------------------------------------------------------------------ ticks

    def tick(self, *, allow_actions: bool) -> None:
        """One round: account outages, reap and restart stopped replicas, and (if allowed and due) act."""
        now = time.monotonic()
        self._account_outages(now - self._last_tick)
        self._last_tick = now
        for slot in self.slots:
            self._supervise(slot, now)
        if allow_actions and now >= self._next_action_at:
            self._act(now)
            self._schedule_next_action()

    def ready_names(self) -> list[str]:
        """The names of the servers serving now."""
        return [s.process.name for s in self.slots if s.ready() and s.process is not None]

    def _account_outages(self, dt_s: float) -> None:
        for span in {slot.span for slot in self.slots}:
            down = not any(s.ready() for s in self.slots if s.span == span)
            if down:
                self.counters.outage_s += dt_s
                if not self._span_down.get(span, False):
                    self.counters.outages += 1
                    self._event(f"outage of span {span[0]}:{span[1]} begins")
            elif self._span_down.get(span, False):
                self._event(f"outage of span {span[0]}:{span[1]} ends")
            self._span_down[span] = down

    def _supervise(self, slot: _Slot, now: float) -> None:
        process = slot.process
        if process is None:
            return
        c = self.config
        if slot.alive():
            if slot.signalled == "SIGTERM" and now - slot.signalled_at > c.stop_grace_s:
                self.counters.slow_exits += 1
                self._event(f"{process.name} still running {c.stop_grace_s:.0f} s after SIGTERM: SIGKILL to its group")
                _kill_group(process)
            elif not slot.signalled and not process.ready_lines() and now - slot.started_at > c.server_ready_timeout_s:
                self.counters.startup_failures += 1
                self._event(f"{process.name} not ready after {c.server_ready_timeout_s:.0f} s: SIGKILL to its group")
                _kill_group(process)
                slot.signalled, slot.signalled_at = "SIGKILL", now
            return
        if slot.restart_at is None:  # it has just exited
            since = f"{now - slot.signalled_at:.1f} s after {slot.signalled}" if slot.signalled else "unasked"
            self._event(f"{process.name} exited (code {process.proc.returncode}) {since}")
            if not slot.signalled:
                self.counters.crashes += 1
                self._event(f"{process.name} exited unasked (code {process.proc.returncode}); see {process.log_path}")
            if not process.wait_group_gone(c.kill_reap_s):
                self.counters.kill_leftovers += 1
                self._event(f"{process.name}: its group outlived it ({slot.signalled or 'crash'}) by {c.kill_reap_s} s")
            process.stop(0.0)  # reaps it, closes its output; SIGKILLs anything left of its group
            delay_s = self.rng.uniform(c.restart_min_delay_s, c.restart_max_delay_s)
            slot.restart_at = now + (c.restart_min_delay_s if slot.outage else delay_s)
        elif now >= slot.restart_at:
            self.counters.restarts += 1
            self._launch(slot)
            self._event(f"restart {slot.process.name if slot.process else '?'}")

    def _act(self, now: float) -> None:
        """SIGKILL or SIGTERM one ready server; the last ready one of its span only for an outage."""
        c = self.config
        ready = [s for s in self.slots if s.ready()]
        if not ready:
            self.counters.skipped += 1
            return
        spare = [s for s in ready if sum(o.span == s.span for o in ready) > 1]
        forced = c.force_outage and self.counters.outages == 0 and now - self._t0 > c.duration_s / 3
        outage = forced or self.rng.random() < c.outage_probability
        if not outage and not spare:
            self.counters.skipped += 1  # only last replicas are up: wait for restarts rather than cut a span
            return
        if outage:
            span = self.rng.choice(sorted({s.span for s in ready}))
            victims = [s for s in ready if s.span == span]  # every ready replica of that span
        else:
            victims = [self.rng.choice(spare)]
        for slot in victims:
            # a forced outage kills: a SIGTERMed server drains and exits over seconds, a restart takes longer still
            sig = signal.SIGKILL if forced or self.rng.random() < c.sigkill_share else signal.SIGTERM
            assert slot.process is not None
            slot.process.signal(sig)  # the server process only: its DHT process and p2pd must follow by themselves
            slot.signalled, slot.signalled_at = sig.name, now
            if sig == signal.SIGKILL:
                self.counters.kills += 1
            else:
                self.counters.terms += 1
            self._event(f"{sig.name} {slot.process.name}{' (outage)' if outage else ''}")
            slot.outage = outage  # then it is restarted soon: clients are waiting


def _kill_group(process: ServerProcess) -> None:
    try:
        os.killpg(process.pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass

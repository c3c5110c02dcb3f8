"""The bad-network side of the field soak: every server launch gets its own `benchmarks.wan_emulator` proxy, which it announces
(`--announce_maddrs`), so every p2p byte to it crosses a link we can break; a seeded schedule then breaks the link of
a random ready server in turn with a stall (every byte held, nothing lost), a drop (connections reset, new dials
unanswered) and a partition from every peer that dials it (its own DHT connections stay up), healed after
`wan_partition_s`. Clients on the same-host socket do not cross the proxies (a socket between processes of one host
does not cross a WAN); p2p clients, servers pushing to each other and the hoarder do. Runs in the caller's thread."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Protocol

from benchmarks.wan.chain import free_port
from benchmarks.wan_emulator import LinkConfig, ProxyThread, WanProxy
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

LINK = LinkConfig(delay_ms=5.0)  # each way, every link: a short WAN (the faults are what the soak is about)
FAULT_KINDS = ("stall", "drop", "partition")


class WanSettings(Protocol):
    """The fields of `ChurnConfig` the fault loop reads (as properties: a protocol's plain attribute must be
    settable, and the config is a frozen dataclass)."""

    @property
    def wan_stall_s(self) -> float: ...

    @property
    def wan_drop_s(self) -> float: ...

    @property
    def wan_partition_s(self) -> float: ...

    @property
    def wan_min_interval_s(self) -> float: ...

    @property
    def wan_max_interval_s(self) -> float: ...


@dataclass
class WanCounters:
    """What the fault loop did: faults applied per kind, and the seconds links were held in all."""

    stalls: int = 0
    drops: int = 0
    partitions: int = 0
    held_s: float = 0.0
    events: list[str] = field(default_factory=list)  # "t=12.3 drop 8 s server0-2r1g0", ...


class WanFaultLoop:
    """`launch_args(name, replaced)` before each server launch (its proxy; the replaced server's is closed); `begin()`;
    then `tick(ready_names)` every ~0.1 s."""

    def __init__(self, config: WanSettings, rng: random.Random, wan: ProxyThread):
        self.config, self.rng, self.wan = config, rng, wan
        self.counters = WanCounters()
        self.proxies: dict[str, WanProxy] = {}  # server name -> the proxy it announces
        self._host_ports: dict[str, int] = {}  # server name -> the port it was told to listen on
        self._t0 = time.monotonic()
        self._next_at = float("inf")
        self._kind = 0
        self._partitioned: list[tuple[WanProxy, float]] = []  # (proxy, heal at)

    def launch_args(self, name: str, replaced: str | None = None) -> tuple[str, ...]:
        """Flags for the server about to start as `name` (in place of `replaced`, whose proxy is closed: its dials
        would only fail): listen on a free port, announce a new proxy to it."""
        old = self.proxies.pop(replaced, None) if replaced is not None else None
        if replaced is not None:
            self._host_ports.pop(replaced, None)
        if old is not None:
            self._partitioned = [(p, at) for p, at in self._partitioned if p is not old]
            self.wan.remove(old)
        port = free_port()
        while port in self._host_ports.values():  # (free again until its server binds it)
            port = free_port()
        # a proxy's listener (port 0) may get a port a server was told to listen on and has not bound yet (it
        # starts seconds later): then that server can't start ("already in use"); such proxies are kept until one
        # lands elsewhere, then closed
        taken = {port, *self._host_ports.values()}
        proxy = self.wan.add(port, LINK)
        spares = []
        while proxy.port in taken:
            spares.append(proxy)
            proxy = self.wan.add(port, LINK)
        for spare in spares:
            self.wan.remove(spare)
        self._host_ports[name] = port
        self.proxies[name] = proxy
        return ("--host_maddrs", f"/ip4/127.0.0.1/tcp/{port}", "--announce_maddrs", f"/ip4/127.0.0.1/tcp/{proxy.port}")

    def begin(self) -> None:
        self._t0 = time.monotonic()
        self._schedule()

    def _schedule(self) -> None:
        c = self.config
        self._next_at = time.monotonic() + self.rng.uniform(c.wan_min_interval_s, c.wan_max_interval_s)

    def _event(self, text: str) -> None:
        line = f"t={time.monotonic() - self._t0:.1f} {text}"
        self.counters.events.append(line)
        logger.info(f"soak.wan({line})")

    def tick(self, ready_names: list[str], *, allow_faults: bool) -> None:
        """Heals partitions that are due; when due (and allowed), breaks the link of one of `ready_names`."""
        now = time.monotonic()
        for proxy, heal_at in list(self._partitioned):
            if now >= heal_at or not allow_faults:
                self.wan.heal(proxy)
                self._partitioned.remove((proxy, heal_at))
                self._event(f"heal port {proxy.port}")
        if not allow_faults or now < self._next_at:
            return
        self._schedule()
        names = sorted(name for name in ready_names if name in self.proxies)
        if not names:
            return
        name = self.rng.choice(names)
        proxy, kind = self.proxies[name], FAULT_KINDS[self._kind % len(FAULT_KINDS)]
        self._kind += 1
        c = self.config
        if kind == "stall":
            self.wan.stall(proxy, c.wan_stall_s)
            self.counters.stalls += 1
            self.counters.held_s += c.wan_stall_s
            self._event(f"stall {c.wan_stall_s:g} s {name}")
        elif kind == "drop":
            self.wan.drop(proxy, c.wan_drop_s)
            self.counters.drops += 1
            self.counters.held_s += c.wan_drop_s
            self._event(f"drop {c.wan_drop_s:g} s {name}")
        else:
            self.wan.partition(proxy)
            self._partitioned.append((proxy, now + c.wan_partition_s))
            self.counters.partitions += 1
            self.counters.held_s += c.wan_partition_s
            self._event(f"partition {c.wan_partition_s:g} s {name}")

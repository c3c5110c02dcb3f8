"""The server's DHT heartbeat: announces its `ServerInfo` for every block it holds (JOINING on start, ONLINE once
its handlers answer, OFFLINE on shutdown), refreshed every `update_period_s` with `expiration_s`, with live
`cache_tokens_left`, `next_pings`, load fields and step rates (`inference_rps`, `forward_rps` as measured from the
steps it served, decision 0165), plus the `_petals.models` record unless the prefix starts with `_`.
While ONLINE it also re-announces early (no new pings) when its free cache moved much since its last record
(`swarm.early_announce`, rate-bounded), so that clients do not route onto room it no longer has."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

from corolla.protocol.records import LOAD_FIELDS, RATE_FIELDS, ModelInfo, ServerInfo, ServerState
from corolla.protocol.uids import make_uid
from corolla.swarm import records_io
from corolla.swarm.early_announce import DEFAULT_EARLY_ANNOUNCE, EARLY_CHECK_PERIOD_S, EarlyAnnounce
from corolla.swarm.ping import PingAggregator, ping
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

MAX_PINGED = 5
PING_EMA_ALPHA = 0.2
DHT_CALL_TIMEOUT_S = 10.0
PING_TIMEOUT_S = 5.0
PING_FORGET_ROUNDS = 3


class Announcer:
    """Runs in the server's asyncio loop; blocking DHT calls go to a worker thread, each with a timeout."""

    def __init__(
        self,
        *,
        dht: Any,
        dht_prefix: str,
        block_indices: range,
        total_blocks: int,
        server_info: ServerInfo,
        model_info: ModelInfo,
        cache_tokens_left: Callable[[], int],
        update_period_s: float,
        load: Callable[[], Mapping[str, Any]] | None = None,
        rates: Callable[[], Mapping[str, float | None]] | None = None,
        expiration_s: float,
        p2p: Any = None,
        local_peer_id: str | None = None,
        ping_authorizer: Any = None,
        on_failure: Callable[[], None] | None = None,
    ):
        self.dht = dht
        self.dht_prefix = dht_prefix
        self.block_indices = block_indices
        self.uids = [make_uid(dht_prefix, i) for i in block_indices]
        self.server_info = server_info
        self.server_info.start_block = block_indices.start
        self.server_info.end_block = block_indices.stop
        self.model_info = model_info
        self.cache_tokens_left = cache_tokens_left
        self.load = load  # the server's load fields (`protocol.records.LOAD_FIELDS`), read at each announcement
        # the step rates measured from the steps it served (`server.core.step_rates`), read at each announcement: each
        # one given replaces the record's figure; where none is given, the figure it started with (start-up's, or
        # none with `--throughput N`) stands
        self.rates = rates
        self._startup_rates = {name: getattr(server_info, name) for name in RATE_FIELDS}
        self.update_period_s = update_period_s
        self.expiration_s = expiration_s
        self.p2p = p2p
        self.local_peer_id = local_peer_id
        self.ping_authorizer = ping_authorizer  # private swarm: members refuse unsigned pings
        self.on_failure = on_failure
        # the blocks after our first one, up to and including the block right after our span
        last_next = min(block_indices.stop + 1, total_blocks)
        self.next_uids = [make_uid(dht_prefix, i) for i in range(block_indices.start + 1, last_next)]
        # smoothed RTTs to the next servers; a peer not pinged for PING_FORGET_ROUNDS announcements (it left, or
        # was not sampled) is forgotten
        self._pings = PingAggregator(ema_alpha=PING_EMA_ALPHA, expiration_s=PING_FORGET_ROUNDS * update_period_s)
        self._trigger = asyncio.Event()
        self._declared = asyncio.Event()  # set (then replaced) after each attempt to store the record
        self._last_declared: ServerState | None = None  # the state of that attempt
        self._task: asyncio.Task | None = None
        self.early_announce: EarlyAnnounce | None = DEFAULT_EARLY_ANNOUNCE  # None: only the heartbeat (Petals')
        self.early_check_period_s = EARLY_CHECK_PERIOD_S
        self.num_early_announcements = 0
        self._cache_capacity = 0  # the most free cache it ever had: the scale of a "large" change

    @property
    def state(self) -> ServerState:
        return self.server_info.state

    def start(self, state: ServerState = ServerState.JOINING) -> None:
        """Announces `state` at once and then every `update_period_s`."""
        self.server_info.state = state
        self._task = asyncio.create_task(self._run(), name="corolla-announcer")

    def rtts_s(self) -> dict[str, float]:
        """The smoothed RTTs (s) it measured to the servers after its first block (peer id -> s, inf = unreachable)."""
        return self._pings.to_dict()

    async def announce(self, state: ServerState, timeout_s: float = 2 * DHT_CALL_TIMEOUT_S + PING_TIMEOUT_S) -> None:
        """Switches state and re-announces now, and returns (within `timeout_s`) once a record of that state was
        stored: a server that says it is ONLINE can be found by a client that reads the records after that. A store
        that fails or times out is logged (the heartbeat tries again), but an OFFLINE not stored within `timeout_s`
        is given up on: the loop is cancelled and over when this returns. Once the loop is over, returns at once."""
        self.server_info.state = state
        self._trigger.set()
        task = self._task
        if task is None or task.done():
            return
        if state == ServerState.OFFLINE:
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout_s)
            except asyncio.TimeoutError:
                logger.warning(f"announcer.offline_timeout(timeout_s={timeout_s})")
                task.cancel()
                await asyncio.wait({task})  # (at its next await: a store's worker thread is not waited for)
            except Exception as e:
                logger.warning(f"announcer.offline_failed({e!r})")
            return
        try:
            await asyncio.wait_for(self._declaration_of(state), timeout_s)
        except asyncio.TimeoutError:
            logger.warning(f"announcer.announce_timeout(state={state.name}, timeout_s={timeout_s})")

    async def _declaration_of(self, state: ServerState) -> None:
        """Returns after the next attempt to store a record of `state` (one that started with another state, in
        flight when the state changed, does not count)."""
        while True:
            await self._declared.wait()
            if self._last_declared == state:
                return

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        early = False  # an early announcement refreshes the figures only; the heartbeat also pings
        while True:
            started = time.monotonic()
            self._trigger.clear()
            state = self.server_info.state
            try:
                await self._announce_once(state, ping=not early)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                logger.warning(f"announcer.failed(state={state.name}): {e!r}")
                if self.on_failure is not None:
                    self.on_failure()
            self._last_declared = state
            declared, self._declared = self._declared, asyncio.Event()
            declared.set()
            if state == ServerState.OFFLINE:
                return
            delay = self.update_period_s - (time.monotonic() - started)
            if delay < 0:
                logger.warning(f"announcer.slow(update_period_s={self.update_period_s}, took={-delay:.1f}s over)")
            early = await self._wait_next(started)
            self.num_early_announcements += early

    async def _wait_next(self, started: float) -> bool:
        """Waits until the update period since `started` ends or `announce` triggers (False), or, while ONLINE, until
        the free cache moved enough for an early announcement (True)."""
        deadline = started + self.update_period_s
        while (left_s := deadline - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(self._trigger.wait(), min(left_s, self.early_check_period_s))
                return False
            except asyncio.TimeoutError:
                pass
            if self._early_due(time.monotonic() - started):
                return True
        return False

    def _early_due(self, since_last_s: float) -> bool:
        if self.early_announce is None or self.server_info.state != ServerState.ONLINE:
            return False
        left_now = max(0, int(self.cache_tokens_left()))
        self._cache_capacity = max(self._cache_capacity, left_now)
        due = self.early_announce.due(
            announced_left=self.server_info.cache_tokens_left,
            left_now=left_now,
            capacity=self._cache_capacity,
            since_last_s=since_last_s,
        )
        if due:
            logger.info(
                f"announcer.early(announced={self.server_info.cache_tokens_left}, left={left_now}, "
                f"since_s={since_last_s:.1f})"
            )
        return due

    async def _announce_once(self, state: ServerState, *, ping: bool = True) -> None:
        self.server_info.cache_tokens_left = max(0, int(self.cache_tokens_left()))
        self._cache_capacity = max(self._cache_capacity, self.server_info.cache_tokens_left)
        if self.load is not None:  # (the load fields given; a missing one stays as it was)
            load = self.load()
            self._apply({name: load[name] for name in LOAD_FIELDS if name in load}, {})
        if self.rates is not None:  # (a missing or bad rate: the start-up figure, or none)
            rates, start = self.rates(), self._startup_rates
            self._apply({n: start[n] if (r := rates.get(n)) is None else float(r) for n in RATE_FIELDS}, start)
        if state != ServerState.OFFLINE:
            if ping:
                await self._ping_next_servers()
            self.server_info.next_pings = self._pings.to_dict()
        else:
            self.server_info.next_pings = None
        expiration_time = time.time() + self.expiration_s  # hivemind's get_dht_time() is wall-clock time
        await asyncio.to_thread(
            records_io.declare_active_modules,
            self.dht,
            self.uids,
            self.server_info,
            expiration_time,
            model_info=self.model_info,  # goes into our signed record (swarm.signed_records)
            timeout_s=DHT_CALL_TIMEOUT_S,
        )
        logger.info(
            f"announcer.declared(state={state.name}, blocks={self.block_indices.start}:{self.block_indices.stop}, "
            f"cache_tokens_left={self.server_info.cache_tokens_left})"
        )
        if state != ServerState.OFFLINE and not self.dht_prefix.startswith("_"):
            await asyncio.to_thread(
                records_io.declare_model_info, self.dht, self.dht_prefix, self.model_info, expiration_time
            )

    def _apply(self, fields: Mapping[str, Any], fallback: Mapping[str, Any]) -> None:
        """Puts each field on the record, checked as readers check it (a bad one: its `fallback`, else what stood)."""
        for name, value in fields.items():
            kept = fallback.get(name, getattr(self.server_info, name))
            setattr(self.server_info, name, value)
            try:
                self.server_info.__post_init__()
            except (TypeError, ValueError) as e:
                logger.warning(f"announcer.bad_field(name={name}): {e}")
                setattr(self.server_info, name, kept)

    async def _ping_next_servers(self) -> None:
        if self.p2p is None or not self.next_uids:
            return
        try:
            infos = await asyncio.to_thread(
                records_io.get_remote_module_infos, self.dht, self.next_uids, latest=True, timeout_s=DHT_CALL_TIMEOUT_S
            )
            middle = {peer for info in infos[:-1] for peer in info.servers}
            last = set(infos[-1].servers) if infos else set()
            middle.discard(self.local_peer_id or "")
            last.discard(self.local_peer_id or "")
            chosen = random.sample(sorted(middle), min(MAX_PINGED, len(middle)))
            chosen += random.sample(sorted(last - set(chosen)), min(MAX_PINGED, len(last - set(chosen))))
            if not chosen:
                return
            from hivemind.p2p import PeerID

            rtts = await asyncio.gather(
                *[
                    ping(PeerID.from_base58(peer), self.p2p, PING_TIMEOUT_S, None, self.ping_authorizer)
                    for peer in chosen
                ],
                return_exceptions=True,
            )
            for peer, rtt in zip(chosen, rtts, strict=True):
                self._pings.update(peer, float(rtt) if isinstance(rtt, (int, float)) else math.inf)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.debug(f"announcer.ping_failed({e!r})")

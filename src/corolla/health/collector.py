"""Keeps the health document fresh: every `refresh_period_s` a background thread reads the model index and every
block's records from a client-mode DHT, pings the online servers and bootstrap peers, and rebuilds the state.

Everything read is untrusted: an index entry declaring more than `max_model_blocks` blocks is skipped, block
records are read `blocks_per_read` keys per DHT call, at most `max_blocks_per_refresh` keys per refresh (smallest
indexed models first), and a model whose records cannot be read or reported is skipped with a log line; the
others stay on the page."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import hivemind
from hivemind.utils.multiaddr import Multiaddr

from corolla.health.state import ModelEntry, build_state
from corolla.protocol.records import RemoteModuleInfo, ServerState
from corolla.protocol.uids import make_uid
from corolla.swarm.dht import run_in_dht
from corolla.swarm.ping import ping_from_dht
from corolla.swarm.records_io import get_remote_module_infos, get_verified_model_infos
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass
class HealthConfig:
    refresh_period_s: float = 30.0  # how often the state is rebuilt (the page polls at the same period)
    dht_timeout_s: float = 20.0  # bound on each DHT read
    ping_timeout_s: float = 3.0  # a server that does not answer a ping in time is shown as unreachable
    check_reachability: bool = True
    use_models_index: bool = True  # also watch every model announced under `_petals.models`
    initial_peers: Sequence[str] = field(default_factory=tuple)  # for the bootstrap peers' states
    max_model_blocks: int = 4096  # an index entry declaring more blocks is garbage (the largest models have ~130)
    max_blocks_per_refresh: int = 16384  # block keys read per refresh over all models; models past it are skipped
    blocks_per_read: int = 256  # block keys per DHT call

    def __post_init__(self) -> None:
        if self.refresh_period_s <= 0:
            raise ValueError(f"refresh_period_s must be > 0, got {self.refresh_period_s}")
        for name in ("max_model_blocks", "max_blocks_per_refresh", "blocks_per_read"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def _bootstrap_peer_ids(initial_peers: Sequence[str]) -> list[str]:
    ids: list[str] = []
    for addr in initial_peers:
        try:
            peer_id = Multiaddr(addr)["p2p"]
        except Exception:  # a multiaddr without /p2p/ cannot be checked
            continue
        if peer_id not in ids:
            ids.append(peer_id)
    return ids


class StateCollector:
    """Owns the refresh thread; `state` is the latest document (a placeholder until the first refresh ends)."""

    def __init__(self, dht: hivemind.DHT, models: Sequence[ModelEntry] = (), config: HealthConfig | None = None):
        self.dht = dht
        self.config = config or HealthConfig()
        self.pinned_models = list(models)
        period_s = self.config.refresh_period_s  # until the first refresh: no model, never updated
        self._state = build_state([], {}, last_updated=None, update_period_s=period_s, update_duration_s=None)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._refreshed = threading.Event()
        self._thread: threading.Thread | None = None
        self._tokens_seen: dict[str, tuple[float, int]] = {}  # peer -> (time.monotonic(), tokens_served) last read

    @property
    def state(self) -> dict[str, Any]:
        with self._lock:
            return self._state

    def wait_first_refresh(self, timeout_s: float) -> bool:
        return self._refreshed.wait(timeout_s)

    def models(self) -> list[ModelEntry]:
        """Pinned models first, then the index's (largest first), each prefix once; index entries over
        `max_model_blocks` are skipped with a log line."""
        models = list(self.pinned_models)
        if self.config.use_models_index:
            seen = {m.dht_prefix for m in models}
            indexed = get_verified_model_infos(self.dht, timeout_s=self.config.dht_timeout_s)
            extra = []
            for prefix, info in indexed.items():
                if prefix in seen:
                    continue
                if info.num_blocks > self.config.max_model_blocks:
                    logger.warning(
                        f"health.model_skipped(prefix={prefix[:60]!r}, num_blocks={info.num_blocks}): more than "
                        f"max_model_blocks={self.config.max_model_blocks}"
                    )
                    continue
                extra.append(ModelEntry(dht_prefix=prefix, num_blocks=info.num_blocks, repository=info.repository))
            models.extend(sorted(extra, key=lambda m: (-m.num_blocks, m.dht_prefix)))
        return models

    def _within_budget(self, models: list[ModelEntry]) -> list[ModelEntry]:
        """The models whose blocks fit `max_blocks_per_refresh`: pinned ones first, then the smallest indexed ones
        (a flood of large fake entries cannot push real models off the page); order kept."""
        budget = self.config.max_blocks_per_refresh
        pinned = {id(m) for m in self.pinned_models}
        chosen: set[int] = set()
        for m in sorted(models, key=lambda m: (id(m) not in pinned, m.num_blocks)):
            if m.num_blocks <= budget:
                chosen.add(id(m))
                budget -= m.num_blocks
            else:
                logger.warning(
                    f"health.model_skipped(prefix={m.dht_prefix[:60]!r}, num_blocks={m.num_blocks}): over "
                    f"max_blocks_per_refresh={self.config.max_blocks_per_refresh} for this refresh"
                )
        return [m for m in models if id(m) in chosen]

    def _read_model(self, model: ModelEntry) -> list[RemoteModuleInfo]:
        """The records of every block of `model`, `blocks_per_read` keys per (bounded) DHT call."""
        infos: list[RemoteModuleInfo] = []
        step = self.config.blocks_per_read
        for start in range(0, model.num_blocks, step):
            uids = [make_uid(model.dht_prefix, i) for i in range(start, min(start + step, model.num_blocks))]
            infos.extend(get_remote_module_infos(self.dht, uids, latest=True, timeout_s=self.config.dht_timeout_s))
        return infos

    def refresh(self) -> dict[str, Any]:
        """Rebuilds the state now (blocking) and returns it."""
        started = time.perf_counter()
        per_model: dict[str, list[RemoteModuleInfo]] = {}
        models = []
        for m in self._within_budget(self.models()):
            try:
                per_model[m.dht_prefix] = self._read_model(m)
                models.append(m)
            except Exception as e:  # one unreadable model must not empty the page
                logger.warning(f"health.model_unreadable(prefix={m.dht_prefix[:60]!r}): {e!r:.300}")
        infos = [info for m in models for info in per_model[m.dht_prefix]]

        rtts: dict[str, float] = {}
        bootstrap_ids = _bootstrap_peer_ids(self.config.initial_peers)
        if self.config.check_reachability:
            online = sorted(
                {p for info in infos for p, s in info.servers.items() if s.state == ServerState.ONLINE}
                | set(bootstrap_ids)
            )
            if online:
                coro = partial(ping_from_dht, peer_ids=online, timeout_s=self.config.ping_timeout_s)
                rtts = run_in_dht(self.dht, coro, timeout_s=self.config.ping_timeout_s + 10, what="health.ping")
        bootstrap_states = ["unreachable" if rtts.get(p) == float("inf") else "online" for p in bootstrap_ids]
        served = self._served_tps(infos, time.monotonic())

        state = build_state(
            models,
            per_model,
            rtts_s=rtts,
            bootstrap_states=bootstrap_states,
            last_updated=time.time(),
            update_period_s=self.config.refresh_period_s,
            update_duration_s=time.perf_counter() - started,
            served_tps=served,
        )
        with self._lock:
            self._state = state
        self._refreshed.set()
        logger.info(
            f"health.refreshed(models={len(models)}, servers={sum(len(r['server_rows']) for r in state['model_reports'])}"
            f", took={state['update_duration']:.2f}s)"
        )
        return state

    def _served_tps(self, infos: list[RemoteModuleInfo], now: float) -> dict[str, float]:
        """Each server's tokens/s since the previous refresh, from the `tokens_served` it announces (a counter that
        went down, i.e. a restart, starts over)."""
        seen = {
            peer: s.tokens_served for info in infos for peer, s in info.servers.items() if s.tokens_served is not None
        }
        served = {}
        for peer, tokens in seen.items():
            previous = self._tokens_seen.get(peer)
            if previous is not None and now > previous[0] and tokens >= previous[1]:
                served[peer] = (tokens - previous[1]) / (now - previous[0])
        self._tokens_seen = {peer: (now, tokens) for peer, tokens in seen.items()}
        return served

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception as e:  # keep the last good state and try again next period
                logger.warning(f"health.refresh_failed({e!r:.300})")
            self._stop.wait(self.config.refresh_period_s)

    def start(self) -> StateCollector:
        self._thread = threading.Thread(target=self._run, name="corolla-health-refresh", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def __enter__(self) -> StateCollector:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

"""Announcer: JOINING at once, refreshes every update period with expiration and live `cache_tokens_left`, ONLINE on
request, OFFLINE stored before `announce(OFFLINE)` returns; `_petals.models` skipped for `_`-prefixes; and the
request validation of `block_functions` (uid chains, shapes, limits)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from corolla.protocol.records import LOAD_FIELDS, ModelInfo, ServerInfo, ServerState
from corolla.server.announcer import Announcer
from corolla.server.front import block_functions as bf
from corolla.swarm.early_announce import EarlyAnnounce


class FakeRecords:
    def __init__(self) -> None:
        self.stored: list[tuple[list[str], tuple, float, float]] = []
        self.models: list[str] = []

    def declare_active_modules(self, dht, uids, server_info, expiration_time, *, timeout_s, model_info=None):
        self.stored.append((list(uids), server_info.to_tuple(), expiration_time, time.time()))
        return {uid: True for uid in uids}

    def declare_model_info(self, dht, prefix, model_info, expiration_time, **_):
        self.models.append(prefix)
        return True


@pytest.fixture
def records(monkeypatch):
    fake = FakeRecords()
    import corolla.swarm.records_io as records_io

    monkeypatch.setattr(records_io, "declare_active_modules", fake.declare_active_modules)
    monkeypatch.setattr(records_io, "declare_model_info", fake.declare_model_info)
    return fake


def make_announcer(prefix: str, cache_left: list[int], **figures: float) -> Announcer:
    return Announcer(
        dht=None,
        dht_prefix=prefix,
        block_indices=range(2, 5),
        total_blocks=8,
        server_info=ServerInfo(state=ServerState.JOINING, throughput=3.0, **figures),  # type: ignore[arg-type]
        model_info=ModelInfo(num_blocks=8),
        cache_tokens_left=lambda: cache_left[0],
        update_period_s=0.2,
        expiration_s=5.0,
    )


async def test_lifecycle_and_refresh(records):
    cache_left = [100]
    announcer = make_announcer("model", cache_left)
    assert announcer.next_uids == ["model.3", "model.4", "model.5"]
    announcer.start()
    await asyncio.sleep(0.05)
    uids, (state, throughput, extra), expiration, stored_at = records.stored[0]
    assert uids == ["model.2", "model.3", "model.4"] and state == ServerState.JOINING and throughput == 3.0
    assert extra["start_block"] == 2 and extra["end_block"] == 5 and extra["cache_tokens_left"] == 100
    assert expiration == pytest.approx(stored_at + 5.0, abs=0.5)
    cache_left[0] = 40
    await announcer.announce(ServerState.ONLINE)  # returns once ONLINE is stored: the ready line comes after it
    assert records.stored[-1][1][0] == ServerState.ONLINE and records.stored[-1][1][2]["cache_tokens_left"] == 40
    count = len(records.stored)
    await asyncio.sleep(0.5)
    assert len(records.stored) >= count + 1  # refreshed every update period
    await announcer.announce(ServerState.OFFLINE)  # returns once OFFLINE is stored and the loop ended
    assert records.stored[-1][1][0] == ServerState.OFFLINE and records.stored[-1][1][2]["next_pings"] is None
    count = len(records.stored)
    await asyncio.sleep(0.4)
    assert len(records.stored) == count
    assert records.models and set(records.models) == {"model"}


async def test_private_prefix_skips_models_index(records):
    announcer = make_announcer("_private", [1])
    announcer.start()
    await asyncio.sleep(0.05)
    await announcer.announce(ServerState.OFFLINE)
    assert records.stored and records.models == []


LIMITS = bf.ServingLimits(
    dht_prefix="p", start_block=2, end_block=5, hidden_size=8, dtype=torch.float32,
    inference_max_length_tokens=16, max_batch_size_tokens=32,
)  # fmt: skip


def test_resolve_chain():
    assert bf.resolve_chain("p.2 p.3 p.4", LIMITS) == [2, 3, 4]
    assert bf.resolve_chain("p.4", LIMITS) == [4]
    for chain, message in [
        ("p.1", "does not serve"), ("p.5", "does not serve"), ("q.2", "does not serve"), ("p.2 p.4", "contiguous"),
        ("p.3 p.2", "contiguous"), ("", "empty"), ("p.2 ", "uid"), ("p.-1", "uid"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            bf.resolve_chain(chain, LIMITS)


def test_tensor_validation():
    good = torch.randn(2, 3, 8)
    assert bf.validate_hidden_states(good, LIMITS) is not None
    with pytest.raises(ValueError, match="max_batch_size of 32"):
        bf.validate_hidden_states(torch.randn(4, 9, 8), LIMITS)
    with pytest.raises(ValueError, match="float"):
        bf.validate_hidden_states(torch.ones(1, 1, 8, dtype=torch.int32), LIMITS)
    assert bf.validate_hidden_states(torch.randn(1, 0, 8), LIMITS, allow_empty_seq=True).shape == (1, 0, 8)
    assert bf.validate_prompts(torch.empty(0), LIMITS, num_blocks=2, batch_size=2, length=3) is None
    prompts = bf.validate_prompts(torch.randn(2, 1, 3, 8), LIMITS, num_blocks=2, batch_size=2, length=3)
    assert prompts is not None and prompts.shape == (2, 1, 3, 8)
    with pytest.raises(ValueError, match="prompts"):
        bf.validate_prompts(torch.randn(2, 3, 3, 8), LIMITS, num_blocks=2, batch_size=2, length=3)
    assert bf.validate_hypo_ids(torch.tensor([1, 0]), batch_size=2).tolist() == [1, 0]
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        bf.validate_hypo_ids(torch.tensor([2, 0]), batch_size=2)
    with pytest.raises(ValueError, match="adapter"):
        bf.validate_adapter("nope", LIMITS)


def test_announced_pings_forget_a_peer_that_left() -> None:
    """The announcer smooths RTTs with the one `PingAggregator` and drops peers not pinged for a few rounds."""
    announcer = make_announcer("model", [100])  # update_period_s=0.2
    pings = announcer._pings
    pings.update("stays", 0.10, now=0.0)
    pings.update("leaves", 0.30, now=0.0)
    pings.update("stays", 0.20, now=0.5)
    assert pings.to_dict(now=0.5) == {"stays": pytest.approx(0.8 * 0.10 + 0.2 * 0.20), "leaves": 0.30}
    assert pings.to_dict(now=0.9) == {"stays": pytest.approx(0.12)}  # 0.9 s > 3 rounds of 0.2 s since "leaves"


async def test_load_fields_are_announced_and_bad_ones_left_out(records):
    load = {"sessions_active": 3, "busy_fraction": 0.5, "tokens_served": 99, "num_moves": 1}
    announcer = make_announcer("model", [10])
    announcer.load = lambda: load
    announcer.start()
    await asyncio.sleep(0.05)
    extra = records.stored[-1][1][2]
    assert (extra["sessions_active"], extra["busy_fraction"], extra["tokens_served"], extra["num_moves"]) == (
        3,
        0.5,
        99,
        1,
    )
    load.update(busy_fraction=float("nan"), sessions_active=4)  # a bug must not make the whole record unreadable
    await announcer.announce(ServerState.ONLINE)
    await asyncio.sleep(0.05)
    extra = records.stored[-1][1][2]
    assert extra["sessions_active"] == 4 and extra["busy_fraction"] == 0.5
    ServerInfo.from_tuple(records.stored[-1][1])
    await announcer.announce(ServerState.OFFLINE)


async def test_measured_rates_replace_the_start_up_figures_which_stand_without_them(records):
    """Each measured step rate given replaces the record's figure; a missing or bad one leaves the figure the server
    started with (an `auto` server's start-up figure; none for `--throughput N`), and `throughput` never moves."""
    measured: dict[str, float | None] = {}
    # an auto server's start-up figures
    announcer = make_announcer("model", [10], inference_rps=50.0, forward_rps=500.0)
    announcer.rates = lambda: measured
    announcer.start()
    await asyncio.sleep(0.05)
    extra = records.stored[-1][1][2]
    assert (extra["inference_rps"], extra["forward_rps"]) == (50.0, 500.0)
    measured.update(inference_rps=20.0, forward_rps=None)
    await announcer.announce(ServerState.ONLINE)
    throughput, extra = records.stored[-1][1][1:]
    assert (throughput, extra["inference_rps"], extra["forward_rps"]) == (3.0, 20.0, 500.0)
    measured.update(inference_rps=float("nan"), forward_rps=900.0)  # a bug must not make the record unreadable
    await announcer.announce(ServerState.JOINING)
    extra = records.stored[-1][1][2]
    assert (extra["inference_rps"], extra["forward_rps"]) == (50.0, 900.0)
    ServerInfo.from_tuple(records.stored[-1][1])
    measured.clear()  # the measured steps expired: the start-up figures again
    await announcer.announce(ServerState.ONLINE)
    assert (records.stored[-1][1][2]["inference_rps"], records.stored[-1][1][2]["forward_rps"]) == (50.0, 500.0)
    await announcer.announce(ServerState.OFFLINE)


async def test_a_throughput_n_server_announces_measured_rates_and_none_without_them(records):
    measured: dict[str, float | None] = {"inference_rps": 30.0, "forward_rps": 300.0}
    announcer = make_announcer("model", [10])  # no start-up figures (`--throughput N`)
    announcer.rates = lambda: measured
    announcer.start()
    await asyncio.sleep(0.05)
    extra = records.stored[-1][1][2]
    assert (extra["inference_rps"], extra["forward_rps"]) == (30.0, 300.0)
    measured.clear()
    await announcer.announce(ServerState.ONLINE)
    extra = records.stored[-1][1][2]
    assert extra["inference_rps"] is None and extra["forward_rps"] is None
    await announcer.announce(ServerState.OFFLINE)


async def test_early_announce_on_a_large_cache_change_is_rate_bounded(records):
    """ONLINE, a server re-announces (without waiting for its heartbeat) when its free cache moved by min_change of
    its capacity, and never sooner than min_interval_s after its last record; a small change waits for the heartbeat."""
    cache_left = [100]
    announcer = make_announcer("model", cache_left)
    announcer.update_period_s = 60.0
    announcer.early_announce = EarlyAnnounce(min_change=0.25, min_interval_s=0.3)
    announcer.early_check_period_s = 0.02
    announcer.start(ServerState.ONLINE)
    await asyncio.sleep(0.1)
    assert len(records.stored) == 1
    cache_left[0] = 90  # a small change: no early record
    await asyncio.sleep(0.4)
    assert len(records.stored) == 1
    cache_left[0] = 40  # 60% of the capacity: announced once the min interval has passed
    await asyncio.sleep(0.2)
    assert records.stored[-1][1][2]["cache_tokens_left"] == 40 and announcer.num_early_announcements == 1
    petals_fields = set(ServerInfo.__dataclass_fields__) - set(LOAD_FIELDS) - {"state", "throughput"}
    assert set(records.stored[-1][1][2]) - set(LOAD_FIELDS) <= petals_fields  # the same record: no new field
    first_early_at = records.stored[-1][3]
    cache_left[0] = 100
    await asyncio.sleep(0.6)
    assert records.stored[-1][1][2]["cache_tokens_left"] == 100 and len(records.stored) == 3
    assert records.stored[-1][3] - first_early_at >= 0.3  # the rate bound
    for left in (0, 100, 0, 100, 0):  # flapping: at most one record per min interval
        cache_left[0] = left
        await asyncio.sleep(0.1)
    assert len(records.stored) <= 3 + 2
    await announcer.stop()


async def test_offline_again_after_a_timed_out_offline_returns(monkeypatch):
    """A drain announces OFFLINE (`server.drain_sessions`), then the server's shutdown does again: where the DHT
    is slow (a store past the first call's bound), the first call gives up and cancels the loop, and the second must
    return, not raise the loop's CancelledError out of the server's `finally` (which then skipped stopping the
    service: its sessions, its runtime)."""
    import corolla.swarm.records_io as records_io

    def slow_store(dht, uids, server_info, expiration_time, *, timeout_s, model_info=None):
        time.sleep(0.3)  # a DHT store past `announce`'s bound (each call is bounded by its own, longer, timeout)
        return {uid: True for uid in uids}

    monkeypatch.setattr(records_io, "declare_active_modules", slow_store)
    monkeypatch.setattr(records_io, "declare_model_info", lambda *args, **kwargs: True)
    announcer = make_announcer("model", [100])
    announcer.start(ServerState.ONLINE)
    await announcer.announce(ServerState.OFFLINE, timeout_s=0.05)  # gives up: the loop is cancelled
    await announcer.announce(ServerState.OFFLINE, timeout_s=0.05)  # the shutdown's: returns
    await announcer.stop()
    await asyncio.sleep(0.4)  # (the worker thread's store ends)

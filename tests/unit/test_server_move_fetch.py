"""A server fetching a move's new span keeps its balance checks going while it serves: once the policy no longer asks
for the move, the download stops before its next block and the move is dropped (before, the whole span was fetched
first, then the move dropped: a quarter of the simulated swarm's fetching, decision 0281)."""

from __future__ import annotations

import asyncio
import time

import pytest
from tests.helpers.tiny_models import make_tiny_model

from corolla.server import server as server_module
from corolla.server.config import ServerConfig
from corolla.server.server import Server

BLOCK_FETCH_S = 0.3  # 8 blocks: 2.4 s; the checks during it come every 0.05 s on average (+ a 0.2 s poll)


class Serving:
    healthy = True


def _fetch(tmp_path, monkeypatch: pytest.MonkeyPatch, still_wanted: bool) -> tuple[str, list[int], list[int]]:
    """(what the fetch of blocks 0-7 ended as, the blocks fetched then, the blocks fetched 0.5 s later) with a policy
    that keeps asking for the move or no longer does."""
    path = make_tiny_model("llama", tmp_path, num_layers=8)
    config = ServerConfig(
        model_name_or_path=str(path), new_swarm=True, torch_dtype="float32", cache_dir=str(tmp_path / "cache"),
        num_blocks=4, mean_balance_check_period_s=0.2,
    )  # fmt: skip
    server = Server(config)
    fetched: list[int] = []

    def slow_fetch(config, model_config, blocks, cancelled):  # type: ignore[no-untyped-def]
        for index in blocks:
            if cancelled.is_set():
                return
            time.sleep(BLOCK_FETCH_S)
            fetched.append(index)

    async def plan_move() -> range | None:
        return range(0, 8) if still_wanted else None

    monkeypatch.setattr(server_module, "fetch_span_blocks", slow_fetch)
    monkeypatch.setattr(server, "_plan_move", plan_move)

    async def fetch() -> str:
        server._async_stop = asyncio.Event()
        return await server._fetch_while_serving(Serving(), range(0, 8))  # type: ignore[arg-type]

    ended = asyncio.run(fetch())
    at_end = list(fetched)
    time.sleep(2 * BLOCK_FETCH_S)
    return ended, at_end, list(fetched)


def test_a_move_still_wanted_fetches_its_whole_span(tmp_path, monkeypatch):
    ended, at_end, later = _fetch(tmp_path, monkeypatch, still_wanted=True)
    assert ended == "fetched" and at_end == later == list(range(8))


def test_a_move_no_longer_wanted_stops_its_fetch(tmp_path, monkeypatch):
    ended, at_end, later = _fetch(tmp_path, monkeypatch, still_wanted=False)
    assert ended == "dropped"
    assert len(at_end) < 8 and len(later) <= len(at_end) + 1  # the block under way finishes, no other starts

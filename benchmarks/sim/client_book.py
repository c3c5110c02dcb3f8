"""What each simulated client has measured, and the RTTs its routes see for the servers it has not (decision 0145).

`unmeasured` rules: `known` (the simulator's older assumption and its default: every client knows its region's RTT to
every server the moment it announces) and `after_failure` (the real client, decision 0137: a client measures the
servers it pings, up to `PLACEMENT_PINGS` it never measured at each refresh, and after a never-measured server fails
it counts every unmeasured server as unreachable for one refresh period and refreshes at once). Counting them
unreachable always lost (decision 0145). A client's book is filled lazily: the refreshes it missed since its last
route are applied when it routes (only routes read it). Made-up servers (`fake_records`) are
records anyone can store: they claim every block at a great speed, never answer a dial or a ping."""

from __future__ import annotations

import math
import random
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from corolla.protocol.records import RemoteSpanInfo, ServerInfo, ServerState
from corolla.swarm.policy import PLACEMENT_PINGS

UNMEASURED_RULES = ("known", "after_failure")
FIRST_PINGS = PLACEMENT_PINGS + 3 * 3  # a fresh client's first refresh: 64 it never measured + 3 of 3 sampled blocks
FAKE_DIAL_S = 5.0  # a made-up peer's dial fails after the client's connect_timeout_s (assumption: not measured)
FAKE_PREFIX = "fake"


def fake_records(count: int, num_blocks: int) -> list[RemoteSpanInfo]:
    """`count` made-up records: every block, 1e9 blocks/s, room for any session."""
    info = ServerInfo(
        ServerState.ONLINE, 1e9, start_block=0, end_block=num_blocks, inference_rps=1e9, cache_tokens_left=1 << 40
    )
    return [RemoteSpanInfo(f"{FAKE_PREFIX}{i:05d}", 0, num_blocks, info) for i in range(count)]


def is_fake(peer_id: str) -> bool:
    return peer_id.startswith(FAKE_PREFIX)


@dataclass
class ClientBook:
    measured: set[str]
    refreshed_s: float
    suspect_until_s: float = -math.inf


class ClientBooks:
    """One book per client (`key`): a closed-loop client's lasts the run, an open arrival's its session."""

    def __init__(self, rule: str, update_period_s: float, rng: random.Random):
        if rule not in UNMEASURED_RULES:
            raise ValueError(f"unmeasured rule must be one of {UNMEASURED_RULES}, got {rule!r}")
        self.rule, self.update_period_s, self.rng = rule, update_period_s, rng
        self._books: dict[Hashable, ClientBook] = {}

    def _ping(self, book: ClientBook, spans: Sequence[RemoteSpanInfo], count: int) -> None:
        unknown = sorted({span.peer_id for span in spans} - book.measured)
        book.measured.update(self.rng.sample(unknown, min(count, len(unknown))))

    def rtts(
        self, key: Hashable, spans: Sequence[RemoteSpanInfo], region_rtts: Mapping[str, float], now_s: float
    ) -> Mapping[str, float]:
        """The RTTs the client's route sees: measured servers' (a made-up one measured is unreachable), and the
        unmeasured ones counted unreachable where the rule says so (else absent: the route assumes a default)."""
        if self.rule == "known":  # made-up servers too: known unreachable
            fakes = {span.peer_id: math.inf for span in spans if is_fake(span.peer_id)}
            return {**fakes, **region_rtts} if fakes else region_rtts
        book = self._books.get(key)
        if book is None:
            book = self._books[key] = ClientBook(set(), now_s)
            self._ping(book, spans, FIRST_PINGS)
        missed = int((now_s - book.refreshed_s) // self.update_period_s)
        if missed > 0:
            book.refreshed_s += missed * self.update_period_s
            self._ping(book, spans, missed * PLACEMENT_PINGS)
        rtts = {
            peer: math.inf if is_fake(peer) else region_rtts[peer]
            for peer in book.measured
            if peer in region_rtts or is_fake(peer)
        }
        if now_s < book.suspect_until_s:
            return {**{span.peer_id: math.inf for span in spans}, **rtts}
        return rtts

    def on_failure(self, key: Hashable, peer_id: str, spans: Sequence[RemoteSpanInfo], now_s: float) -> None:
        """A server failed the client's call: where it never measured it, every unmeasured server is suspect for one
        refresh period (`after_failure`), and the client refreshes at once (its pings measure more of them)."""
        book = self._books.get(key)
        if book is None or self.rule == "known" or peer_id in book.measured:
            return
        book.suspect_until_s = now_s + self.update_period_s
        self._ping(book, spans, PLACEMENT_PINGS)

    def forget(self, key: Hashable) -> None:
        self._books.pop(key, None)

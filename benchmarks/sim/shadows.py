"""Shadow sessions in the simulator (issue 37, decision 0268): what verification by shadows (decision 0042,
`client.session.shadows`) costs a whole swarm. As the real client, each span session (a hop of a session's chain,
each time a chain is made or a hop moved) is mirrored with probability `fraction`, on a replica drawn at random among
the servers of the client's view that hold the hop's blocks whole, the hop's server and those its client bans left
out (`StretchReferees.replicas`, then its first; the sim has no disputes, so no co-witness goes last); with none,
the hop is not verified. The shadow opens a session of the span session's length on the replica: it reserves the
same KV there (a replica without room refuses it, and the hop goes unverified, as the real shadow's failed open) and
holds it until the hop ends, or until a real session needs that room: a corolla replica's admission ends shadows,
youngest first, for a real newcomer (`server.core.admission`; a stock Petals replica does not). Its decode positions
reach the replica `SHADOW_BATCH_ROWS` at a time as rows of its merged steps (`shadow_rows`), at the hop's own pace
(the session's tokens/s). Its prefill positions are not charged, as no prefill (a real session's prompt, a replayed
history) is charged to any server's steps in the simulator: the shadows add to the steps what they add to the decode
rows, the fraction that 0260 measured. A replica that leaves or moves ends its shadows (the hop goes on unverified).
`hold_kv=False` keeps the rows and drops the KV: the two costs apart."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from benchmarks.sim.metrics import Metrics
from benchmarks.sim.server_model import SimServer
from benchmarks.sim.shadow_rows import ShadowLoad
from benchmarks.sim.workload import Conversation
from corolla.client.session.shadows import SHADOW_BATCH_ROWS
from corolla.protocol.records import ServerState

ZERO_RATE = 1e-9  # requests/s below which a replica's summed shadow load is float residue of removals: reset to 0


class MirroredSession(Protocol):
    """What the book reads and keeps of a simulated session (`client_model.SimSession`)."""

    sid: int
    conversation: Conversation
    counted: bool  # opened after the warm-up: its shadows are counted
    route: list[tuple[SimServer, int, int]] | None
    shadows: list[SimShadow | None]  # by hop of `route`
    visit_rate: float  # its decode tokens/s now
    context: int


S = TypeVar("S", bound=MirroredSession)


@dataclass(eq=False)
class SimShadow:
    """One hop's shadow: blocks [start, end) of `session`'s chain mirrored on `replica`, holding `need` tokens of KV
    there; `load` is what it sends the replica now (`ShadowLoad`)."""

    session: MirroredSession
    replica: SimServer
    start: int
    end: int
    need: int
    opened_s: float
    load: ShadowLoad = field(default_factory=ShadowLoad)

    @property
    def weight(self) -> float:
        """Its share of the replica's span: a row of it costs that share of a full-span row."""
        return (self.end - self.start) / max(self.replica.num_blocks, 1)


def held_kv(server: SimServer) -> int:
    """The KV its shadows reserved on `server` (token x block slots)."""
    return sum(x.need * (x.end - x.start) for x in server.shadows if isinstance(x, SimShadow))


def shadow_costs(server: SimServer) -> tuple[float, float]:
    """How much longer `server`'s steps take with its shadows' requests than without, and a decode token's time
    through its span (`SimServer.hop_s`: the step in progress waited for, shadow-only steps included); (0, 0): none."""
    if server.shadow_load.requests_per_s <= 0:
        return 0.0, 0.0
    step_s, hop_s = server.batch()[1], server.hop_s(server.num_blocks)
    load, server.shadow_load = server.shadow_load, ShadowLoad()
    try:
        return step_s / server.batch()[1] - 1, hop_s / server.hop_s(server.num_blocks) - 1
    finally:
        server.shadow_load = load


class ShadowBook(Generic[S]):
    """Every shadow of a run. `candidates(session, start, end, server)`: peer ids of the client's view that could be
    the replica of `session`'s hop over [start, end) on `server` (`Simulation._replica_candidates`)."""

    def __init__(
        self,
        fraction: float,
        rng: random.Random,
        candidates: Callable[[S, int, int, str], list[str]],
        servers: Mapping[str, SimServer],
        metrics: Metrics,
        now_s: Callable[[], float],
        *,
        hold_kv: bool = True,
    ):
        self.fraction, self.rng, self.candidates = fraction, rng, candidates
        self.servers, self.metrics, self.now_s, self.hold_kv = servers, metrics, now_s, hold_kv

    def draw(self, session: S, first: int, count: int) -> None:
        """Draws the shadows of `session`'s hops [first, first + count), new span sessions (`session.shadows` holds
        None there)."""
        assert session.route is not None
        for index in range(first, first + count):
            server, start, end = session.route[index]
            if not (self.fraction >= 1 or self.rng.random() < self.fraction):
                continue
            self._count(session, "shadows_drawn")
            peers = self.candidates(session, start, end, server.peer_id)
            if not peers:
                self._count(session, "shadows_no_replica")
                continue
            replica = self.servers.get(self.rng.choice(peers))
            if (
                replica is None
                or replica.state != ServerState.ONLINE
                or not replica.start <= start < end <= replica.end
            ):
                self._count(session, "shadows_failed")  # the view's record is older than its move or departure
                continue
            need = session.conversation.total_tokens if self.hold_kv else 0
            if need and replica.kv_free_tokens(start, end) < need:
                self._count(session, "shadows_refused")
                continue
            if need:
                replica.reserve(start, end, need)
            shadow = SimShadow(session, replica, start, end, need, self.now_s())
            replica.shadows.add(shadow)
            session.shadows[index] = shadow
            self._count(session, "shadows_opened")

    def room(self, server: SimServer, start: int, end: int, need: int) -> bool:
        """Whether a real session's `need` tokens fit on blocks [start, end) of `server` once its shadows there yield
        (`server.core.admission`: a shadow yields whole to a real newcomer, youngest first)."""
        if server.kv_free_tokens(start, end) >= need:
            return True
        if server.pooled_kv:  # a stock Petals replica: its shadows are sessions like any other
            return False
        yielding = [x for x in self._holding(server) if x.start < end and start < x.end]
        if not yielding:
            return False
        freed = {block: sum(x.need for x in yielding if x.start <= block < x.end) for block in range(start, end)}
        reserved = max(server.kv_reserved.get(block, 0) - freed[block] for block in range(start, end))
        return server.kv_capacity_tokens - reserved >= need

    def make_room(self, server: SimServer, start: int, end: int, need: int) -> None:
        """Ends `server`'s shadows on blocks [start, end), youngest first, until a real session's `need` tokens fit
        there (`room` said they would)."""
        yielding = [x for x in self._holding(server) if x.start < end and start < x.end]
        for shadow in sorted(yielding, key=lambda x: (-x.opened_s, x.session.sid, x.start)):
            if server.kv_free_tokens(start, end) >= need:
                return
            self._end_shadow(shadow)
            self._count(shadow.session, "shadows_evicted")

    def pace(self, session: MirroredSession) -> None:
        """Sets what each of `session`'s shadows sends its replica from now: its decode positions at the session's
        pace (`visit_rate` tokens/s), each request reading the session's KV."""
        positions_s = session.visit_rate
        for shadow in session.shadows:
            if shadow is None:
                continue
            requests = positions_s / SHADOW_BATCH_ROWS
            weight = shadow.weight
            self._set(shadow, ShadowLoad(requests, positions_s * weight, requests * session.context * weight))

    def end(self, session: MirroredSession, index: int) -> None:
        """Ends the shadow of `session`'s hop `index` (the hop ends or moves), freeing its KV on the replica."""
        shadow = session.shadows[index]
        if shadow is not None:
            self._close(shadow)
            session.shadows[index] = None

    def end_all(self, session: MirroredSession) -> None:
        for index in range(len(session.shadows)):
            self.end(session, index)
        session.shadows = []

    def replica_lost(self, server: SimServer) -> None:
        """`server` left or moved: the shadows it ran end (their hops go on, unverified)."""
        shadows = sorted(
            (x for x in server.shadows if isinstance(x, SimShadow)), key=lambda x: (x.session.sid, x.start)
        )
        for shadow in shadows:
            self._end_shadow(shadow)
            self._count(shadow.session, "shadows_lost")

    @staticmethod
    def _holding(server: SimServer) -> list[SimShadow]:
        """`server`'s shadows that hold KV there."""
        return [x for x in server.shadows if isinstance(x, SimShadow) and x.need]

    def _end_shadow(self, shadow: SimShadow) -> None:
        index = next(i for i, s in enumerate(shadow.session.shadows) if s is shadow)
        self.end(shadow.session, index)

    def credit(self, session: MirroredSession, tokens: int, now_s: float) -> None:
        """`tokens` decoded through `session`'s chain: the positions its shadows replay for them and the real work,
        in block-positions (each hop's tokens x its blocks), in the measured window."""
        if now_s < self.metrics.measure_from_s or session.route is None:
            return
        for (_, start, end), shadow in zip(session.route, session.shadows, strict=True):
            self.metrics.token_blocks += tokens * (end - start)
            if shadow is not None:
                self.metrics.shadow_position_blocks += tokens * (end - start)

    def _set(self, shadow: SimShadow, load: ShadowLoad) -> None:
        total = shadow.replica.shadow_load
        total.add(shadow.load, -1.0)
        total.add(load)
        if total.requests_per_s < ZERO_RATE:
            total.requests_per_s = total.rows = total.context = 0.0
        shadow.load = load

    def _close(self, shadow: SimShadow) -> None:
        self._set(shadow, ShadowLoad())
        shadow.replica.shadows.discard(shadow)
        if shadow.need:
            shadow.replica.reserve(shadow.start, shadow.end, -shadow.need)

    def _count(self, session: MirroredSession, counter: str) -> None:
        if session.counted:
            setattr(self.metrics, counter, getattr(self.metrics, counter) + 1)

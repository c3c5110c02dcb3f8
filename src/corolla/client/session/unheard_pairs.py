"""A race's pair that lost its round with no referee heard ("unheard": decision 0248,
`InferenceSession._judge_lost_pairs`) is asked again after the race (decision 0253): an attacker keeps an honest
outsider busy for one round cheaply (0232), not for minutes at moments it cannot foresee, so a referee heard later
tells an honest pair from a liar pair. The pair's recheck (the trial's inputs and the pair's outputs, already held) is
asked after growing, randomly drawn waits, and the first answer judges the pair as one heard at once would have
(0238): "split" where a referee confirms it (what "unheard" spent is given back, its watch ended), "refuted" where
referees answer and none confirms (both lose their standing and are avoided). Still unheard after the last ask:
0248's verdict stands.

Only a pair holding a standing is asked again. Bounded: `len(RETRY_WAITS_S)` asks per pair and race within
`RETRY_BOUND_S`; one job per pair, each held by a peer of standing of its pair that holds no other (0256: k
identities of standing make k(k-1)/2 pairs), and `RETRIES_MAX` per client. The jobs outlive their session, as its
judgements do (0245), and end when the client shuts down (`RemoteSequenceManager.on_shutdown`)."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from corolla.client import background_loop
from corolla.client.routing.disputes import Dispute
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.session.replacement_race import RaceEvent
from corolla.client.verification.witnesses import UNCHECKED, WATCH_S, Rechecked, refuted
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

# the waits before each ask again (the attacker's busy messages must cover every one: 3 minutes and more in all)
RETRY_WAITS_S = (5.0, 15.0, 45.0, 120.0)
RETRY_JITTER = 0.5  # each wait drawn in [1 - j, 1 + j] of its figure: the asks' moments are not the attacker's to know
RETRY_BOUND_S = WATCH_S  # a job's whole run (its asks' forwards included): within the pair's watch
RETRIES_MAX = 16  # jobs running at once per client
CANCEL_TIMEOUT_S = 5.0  # the longest the client's shutdown waits for its jobs to end


@dataclass(frozen=True)
class UnheardPair:
    """A pair judged "unheard" in a race for `blocks` that `winner` won, its trial agreeing with `accused`'s (the left
    server's) earlier outputs: the standings its verdict spent (each peer with its `BanList.spend` id), its watch
    (None: not watched), the pair's recheck to ask again (`pair_referee.referee_pair` with the race's inputs), the
    session's race events, where the re-judgement is recorded, and the peers the race refuted so far (shared by its
    pairs: a peer is refuted once per race however many of its pairs lost, as 0238 judges them at once)."""

    blocks: tuple[int, int]
    pair: tuple[str, ...]
    accused: str
    winner: str
    spent: tuple[tuple[str, int], ...]
    watch: Dispute | None
    ask: Callable[[], Awaitable[Rechecked]]
    events: list[RaceEvent]
    refuted: set[str] = field(default_factory=set, compare=False)

    @property
    def holders(self) -> tuple[str, ...]:
        """The pair's peers whose standing it holds a retry slot by: the one it spent (lent to a fresh partner), else
        both (two standings of their own, kept)."""
        return tuple(peer for peer, _ in self.spent) or self.pair


class UnheardRetries:
    """One client's jobs asking unheard pairs' referees again (`retries_of`); started on the client's loop."""

    def __init__(self, shut: bool = False) -> None:
        self._jobs: dict[frozenset[str], asyncio.Future[None]] = {}
        # each job's holder: a peer of standing of its pair that holds no other job (decision 0256: pairs cost the
        # attacker nothing past the standings, and k identities of standing make k(k-1)/2 pairs); the peers each
        # job may be held by (`UnheardPair.holders`), so that a job is moved to another where a new one needs its
        self._held_by: dict[str, frozenset[str]] = {}
        self._holders: dict[frozenset[str], tuple[str, ...]] = {}
        self._shut = shut

    @property
    def running(self) -> int:
        return len(self._jobs)

    def start(self, manager: RemoteSequenceManager, unheard: UnheardPair) -> bool:
        """Starts asking `unheard`'s referees again; False (0248's verdict stands alone) where the client shut down,
        a job for the same pair runs, `RETRIES_MAX` jobs run, or no peer its slot could be held by
        (`UnheardPair.holders`) is free, even with the running jobs' holders moved among their own pairs. One slot
        per standing: the attacker's k identities of standing hold k slots at most, not one per pair of them, and
        never one an honest peer's own job needs where its partner is free to hold it (decision 0256)."""
        key = frozenset(unheard.pair)
        refused = self._shut or key in self._jobs or len(self._jobs) >= RETRIES_MAX
        if not refused:
            self._holders[key] = unheard.holders
            refused = not self._seat(key, set())
            if refused:
                del self._holders[key]
        if refused:
            logger.info(
                "unheard_pairs.not_retried(pair=%s, running=%d, same_pair=%s, shut=%s)",
                names(unheard.pair), len(self._jobs), key in self._jobs, self._shut,
            )  # fmt: skip
            return False
        job = asyncio.ensure_future(self._retry(manager, unheard))
        self._jobs[key] = job

        def done(_: asyncio.Future[None]) -> None:
            if self._jobs.get(key) is job:
                del self._jobs[key]
                del self._holders[key]
                for peer in [peer for peer, held in self._held_by.items() if held == key]:
                    del self._held_by[peer]

        job.add_done_callback(done)
        return True

    def _seat(self, key: frozenset[str], seen: set[str]) -> bool:
        """Gives job `key` a holder among its `_holders`: a free one, or one whose job can be moved to another peer
        of its own (an augmenting path over at most `RETRIES_MAX` jobs); changes nothing where none can."""
        for peer in self._holders[key]:
            if peer in seen:
                continue
            seen.add(peer)
            held = self._held_by.get(peer)
            if held is None or self._seat(held, seen):
                self._held_by[peer] = key
                return True
        return False

    async def _retry(self, manager: RemoteSequenceManager, unheard: UnheardPair) -> None:
        try:
            rechecked = await asyncio.wait_for(_ask_again(manager, unheard), RETRY_BOUND_S)
        except asyncio.TimeoutError:
            rechecked = UNCHECKED
        rejudge(manager, unheard, rechecked)

    def cancel(self) -> None:
        """Ends every job, and starts none after (the client shuts down): waited for from a thread other than the
        client loop's, `CANCEL_TIMEOUT_S` at most."""
        self._shut = True

        def cancel_all() -> list[asyncio.Future[None]]:
            jobs = list(self._jobs.values())
            for job in jobs:
                job.cancel()
            return jobs

        async def ended() -> None:
            await asyncio.gather(*cancel_all(), return_exceptions=True)

        if background_loop.on_loop():
            cancel_all()
            return
        # (cancelled whenever the loop runs, whether or not the wait below ends)
        background_loop.get_loop().call_soon_threadsafe(cancel_all)
        try:
            background_loop.run(ended(), timeout_s=CANCEL_TIMEOUT_S)
        except TimeoutError:  # the client loop held elsewhere: the shutdown goes on
            logger.warning("unheard_pairs.cancel_unfinished(jobs=%d)", len(self._jobs))


_RETRIES: weakref.WeakKeyDictionary[RemoteSequenceManager, UnheardRetries] = weakref.WeakKeyDictionary()


def retries_of(manager: RemoteSequenceManager) -> UnheardRetries:
    """The retry jobs of `manager`'s client (made at first use, ended by its shutdown)."""
    retries = _RETRIES.get(manager)
    if retries is None:
        # (a race's judgement may end after the client's shutdown, its first unheard pair judged then: no job)
        retries = _RETRIES[manager] = UnheardRetries(shut=manager.closed)
        manager.on_shutdown.append(retries.cancel)
    return retries


async def _ask_again(manager: RemoteSequenceManager, unheard: UnheardPair) -> Rechecked:
    """`unheard`'s recheck asked after each of `RETRY_WAITS_S` (jittered) until a referee answers; "unchecked"
    where none did."""
    for wait_s in RETRY_WAITS_S:
        await asyncio.sleep(wait_s * manager.rng.uniform(1 - RETRY_JITTER, 1 + RETRY_JITTER))
        try:
            rechecked = await unheard.ask()
        except Exception as e:  # (`recheck` counts a referee's failure as silence: not expected)
            logger.warning("unheard_pairs.ask_failed(pair=%s, error=%r)", names(unheard.pair), e)
            continue
        if rechecked.verdict != "unchecked":
            return rechecked
    return UNCHECKED


def rejudge(manager: RemoteSequenceManager, unheard: UnheardPair, rechecked: Rechecked) -> str:
    """Judges `unheard` by `rechecked` (its referees asked again) as 0238 judges a lost pair whose referees answered,
    the winner's trial one more outside server that disagreed: "split" where a referee confirmed the pair (the
    standings "unheard" spent given back, its watch ended: nobody's word against the pair but the winner's, which
    may be the liar's); "refuted" where referees answered and none confirmed (both lose their standing and are
    avoided, `witnesses.refuted`, each once per race: `UnheardPair.refuted`); "unheard" where none answered (0248's
    verdict stands: what it spent is lost for good). Recorded as a `rejudged` race event; returns the verdict."""
    verdict = lost_pair_verdict(rechecked)
    if verdict != "unheard" and unheard.watch is not None:
        manager.disputes.close(unheard.watch)
    for peer, spend_id in unheard.spent:  # (this verdict's spend only: another race's on the same peer is its own)
        if verdict == "split":
            manager.bans.give_back(peer, spend_id)
        else:
            manager.bans.forfeit(peer, spend_id)
    if verdict == "refuted":
        refute_once(manager, unheard.pair, unheard.refuted)
    unheard.events.append(RaceEvent(unheard.blocks, "rejudged", unheard.pair, verdict))
    logger.info(
        "unheard_pairs.rejudged(blocks=%d:%d, pair=%s, winner=...%s, referees=%s): %s",
        *unheard.blocks, names(unheard.pair), unheard.winner[-6:], rechecked.verdict, verdict,
    )  # fmt: skip
    return verdict


def lost_pair_verdict(rechecked: Rechecked) -> str:
    """A lost race pair's verdict by its referees' recheck (decisions 0238, 0248): "unheard" where none answered,
    "split" where one confirmed the pair, else "refuted"."""
    if rechecked.verdict == "unchecked":
        return "unheard"
    return "split" if rechecked.confirmed_by else "refuted"


def refute_once(manager: RemoteSequenceManager, pair: Sequence[str], refuted_peers: set[str]) -> None:
    """Refutes `pair`'s peers not in `refuted_peers` (the race's so far) and adds them: standing lost (0208), avoided
    longer each time (0225), once per race however many of its pairs lost (0238, 0256)."""
    for peer in set(pair) - refuted_peers:
        refuted(manager, peer)
    refuted_peers.update(pair)


def names(peers: Sequence[str]) -> str:
    """Peer ids as their last six characters, for logs."""
    return ", ".join("..." + peer[-6:] for peer in peers)

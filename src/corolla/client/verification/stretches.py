"""Deciding whether a server's claimed outputs for a stretch of a span's session are wrong (`StretchReferees`): a
replica of the span recomputes the stretch as one stateless `rpc_forward` over the span's inputs for positions [0, b)
and its deep prompts (an existing RPC: stock Petals servers serve as referees and are checked too), and the outputs
the server claimed for positions [first, b) are compared position by position within the dtype's tolerance. A
disagreement is decided by a second replica: the server outvoted 2:1 is banned for good where one of the two has a
witness's standing and no replica outside the three refutes them (`recheck`, decision 0208), else avoided and the two
watched (`verification.witnesses`, 0190); with no second replica nobody is banned (one referee's lie must never ban
an honest server), and the finding is kept. Asked by `client.session.shadows` (the shadow's outputs are the first
referee's answer) and `client.verification.finding_check` (a shared finding, re-verified first-hand); sessions are
checked by shadows, not by sampled stretches (0042)."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Literal

import torch

from corolla.client.calls.output_checks import comparison_rtol
from corolla.client.calls.remote_forward_backward import NO_PROMPTS
from corolla.client.routing.findings import Finding
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.verification.chains import (
    HOPS_PER_SEAT,
    Chain,
    HopAnswers,
    HopBudget,
    Outsiders,
    chain_forward,
    chains_over,
)
from corolla.client.verification.witnesses import (
    OUTSIDERS_MAX,
    RECORD_SEATS,
    UNCHECKED,
    Rechecked,
    needs_recheck,
    outvote,
    recheck,
    trusted,
)
from corolla.protocol.records import RemoteSpanInfo
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


def position_errors(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Relative L2 error per position of `a`, `b` [B, T, H] -> [B, T] (float32; 0 where both are zero)."""
    a32, b32 = a.float(), b.float()
    scale = torch.maximum(a32.norm(dim=-1), b32.norm(dim=-1)).clamp_min(1e-12)
    return (a32 - b32).norm(dim=-1) / scale


# "caught" / "referee_lied": the server / the first referee outvoted 2:1 and banned for good; "disputed" /
# "referee_disputed": outvoted by witnesses short of standing, avoided only (`witnesses.outvote`)
Verdict = Literal["caught", "undecided", "referee_lied", "disputed", "referee_disputed"]


def record_floors(standing_steps: int) -> list[int]:
    """The records of verified agreeing steps in a row (`BanList.agreed_in_a_row`) that `StretchReferees.outsiders`
    gives its record seats by, longest first: a witness's standing (`standing_steps`), halved down to one step (8: 8,
    4, 2, 1). An attacker's identity shares a floor with an honest server of record r only with r // 2 + 1 steps or
    more of its own, each a step of this client's own route (or a referee's recompute of one) computed right and
    checked against another server; with one floor for any record, one verified step each bought that."""
    floors = [standing_steps] if standing_steps else []
    while floors and floors[-1] > 1:
        floors.append(floors[-1] // 2)
    return floors


def _route(chain: Chain) -> tuple[tuple[str, int], ...]:
    return tuple((hop.peer_id, hop.start) for hop in chain.hops)


class StretchReferees:
    """Replicas of a span, asked to recompute a stretch of its session and outvote a wrong answer 2:1."""

    def __init__(self, manager: RemoteSequenceManager, *, rng: random.Random | None = None):
        self.manager = manager
        self.rng = rng or random.Random()

    def replicas(self, span: RemoteSpanInfo, exclude: set[str], *, avoided: bool = False) -> list[RemoteSpanInfo]:
        """Unbanned servers of the view (and, where `avoided`, those avoided now: `avoided_spans`) holding all of
        `span`'s blocks, not in `exclude`, in random order, as spans of them; the co-witnesses of its server in an open
        dispute last (`routing.disputes`: one attacker's identities would vouch for each other; their agreement earns
        no standing, `Disputes.co_witnesses`)."""
        banned = self.manager.bans.banned_peers()
        candidates = {s.peer_id: s for s in self.manager.spans}
        if avoided:
            candidates = {s.peer_id: s for s in self.manager.avoided_spans()} | candidates
        others = [
            RemoteSpanInfo(peer_id=s.peer_id, start=span.start, end=span.end, server_info=s.server_info)
            for s in candidates.values()
            if s.peer_id not in exclude and s.peer_id not in banned and s.start <= span.start and span.end <= s.end
        ]
        self.rng.shuffle(others)
        co_witnesses = self.manager.disputes.co_witnesses(span.peer_id)
        others.sort(key=lambda other: other.peer_id in co_witnesses)
        return others

    def outsiders(self, span: RemoteSpanInfo, parties: set[str]) -> Outsiders:
        """Servers outside a dispute's `parties` (the accused and its witnesses) that hold `span`'s blocks whole, and
        chains of them that hold the blocks together (`chains.chains_over`, decision 0234), avoided ones too (0228: an
        attacker's fresh pair gets any honest server avoided), to recheck it before a ban on standing (0208). The
        seats, `OUTSIDERS_MAX`, in tiers, each given per server (0239): the chains whose every server has a witness's
        standing first (0237), then any; in each, servers that are co-witnesses of a party in an open dispute after
        all the rest. Then `RECORD_SEATS` more, added, not reordered, to the chains not seated yet whose weakest
        server has the longest record of verified work with this client (`record_floors`; 0246): identities
        announcing the honest servers' own blocks differ from them only by the work this client saw them do.

        The chains are asked only as far as their distinct hop forwards fit `HOPS_PER_SEAT` per seat (0250, 0254):
        the per-server seats' share fewest hops first, so every chain of at most `HOPS_PER_SEAT` hops there is asked
        whatever the others are; what is left to the record seats' chains and those cut, by the weakest server's
        record floor first, fewest hops first within a floor, so that an honest long chain with standing or a record
        is not cut by an attacker's shorter chains."""
        banned = self.manager.bans.banned_peers()
        candidates = {s.peer_id: s for s in self.manager.avoided_spans()} | {s.peer_id: s for s in self.manager.spans}
        holders = [
            s
            for s in candidates.values()
            if s.peer_id not in parties and s.peer_id not in banned and s.start < span.end and span.start < s.end
        ]
        co_witnesses = set().union(*(self.manager.disputes.co_witnesses(peer) for peer in parties))
        plain = [s for s in holders if s.peer_id not in co_witnesses]
        tiers = [
            [s for s in plain if trusted(self.manager, s.peer_id)],
            plain,
            [s for s in holders if trusted(self.manager, s.peer_id)],
            holders,
        ]
        seated: dict[tuple[tuple[str, int], ...], Chain] = {}
        for tier in tiers:
            outsiders = chains_over(span, tier, self.rng, OUTSIDERS_MAX)
            for chain in outsiders.chains:
                seated.setdefault(_route(chain), chain)
            if len(seated) >= OUTSIDERS_MAX:
                break
        unheard = outsiders.unheard  # (the last tier's, `holders`, or one that had chains: 0, as `holders`')
        chains = list(seated.values())[:OUTSIDERS_MAX]
        seats = len(chains)
        # the record seats: chains not seated yet, by their weakest server's record of verified work. Seated means
        # among the `OUTSIDERS_MAX` asked, not drawn by a tier: a tier past the first may draw more than the seats left
        # (a recorded honest chain drawn there and cut was kept out of the record seats too: decision 0247)
        asked = {_route(chain) for chain in chains}
        record = {s.peer_id: self.manager.bans.agreed_in_a_row(s.peer_id) for s in holders}
        recorded: dict[tuple[tuple[str, int], ...], Chain] = {}
        for group in (plain, holders):
            for floor in record_floors(self.manager.config.witness_standing_steps):
                tier = [s for s in group if record[s.peer_id] >= floor]
                for chain in chains_over(span, tier, self.rng, RECORD_SEATS + len(chains)).chains:
                    if _route(chain) not in asked:
                        recorded.setdefault(_route(chain), chain)
                if len(recorded) >= RECORD_SEATS:
                    break
            if len(recorded) >= RECORD_SEATS:
                break
        chains += list(recorded.values())[:RECORD_SEATS]
        # a bounded number of hop forwards (decisions 0250, 0254): the per-server seats `HOPS_PER_SEAT` each, fewest
        # hops first; what is left, the record seats' share at least, to the record seats' chains and those cut, by
        # the record of their weakest server first. A chain cut is a word not heard (an honest one cut must not leave
        # a ban resting on one standing: decision 0232's rule)
        budget = HopBudget(HOPS_PER_SEAT * (OUTSIDERS_MAX + RECORD_SEATS))
        per_server = budget.take(chains[:seats], up_to=HOPS_PER_SEAT * OUTSIDERS_MAX)
        kept = {_route(chain) for chain in per_server}
        floors = record_floors(self.manager.config.witness_standing_steps)

        def by_record(chain: Chain) -> tuple[int, ...]:
            """Plain chains before those with a co-witness, each by its weakest server's record floor, longest first
            (the order of the record seats)."""
            weakest = min(record[peer] for peer in chain.peer_ids)
            floor = next((floor for floor in floors if weakest >= floor), 0)
            return (any(peer in co_witnesses for peer in chain.peer_ids), -floor)

        by_record_kept = budget.take([chain for chain in chains if _route(chain) not in kept], first=by_record)
        kept |= {_route(chain) for chain in by_record_kept}
        bounded = [chain for chain in chains if _route(chain) in kept]
        unheard += len(chains) - len(bounded)
        answers = HopAnswers()  # (the recheck's chains that start alike ask those hops once: decision 0237)
        return Outsiders([Chain(chain.hops, answers) for chain in bounded], unheard, answers)

    async def recheck(
        self, span: RemoteSpanInfo, finding: Finding, witnesses: tuple[RemoteSpanInfo, RemoteSpanInfo],
        agreed: torch.Tensor, accused: RemoteSpanInfo, known: Mapping[str, torch.Tensor | None] | None = None,
    ) -> Rechecked:  # fmt: skip
        """Where `witnesses` (agreeing on `agreed` [B, b - first, H]) would ban `accused` on standing, replicas of
        `span` outside the three recompute `finding`'s stretch first, each to confirm `agreed` (decision 0208); those
        in `known` answered it already (`answer`)."""
        if not needs_recheck(self.manager, accused.peer_id, [witness.peer_id for witness in witnesses]):
            return UNCHECKED

        async def confirms(outsider: Chain) -> bool | None:
            theirs = await self.chain_answer(span, outsider, finding, known)
            return None if theirs is None else self.compare(theirs, agreed, (*outsider.hops, witnesses[0]))[0]

        parties = {accused.peer_id, *(witness.peer_id for witness in witnesses)}
        return await recheck(self.outsiders(span, parties), confirms)

    async def recompute(self, replica: RemoteSpanInfo, finding: Finding) -> torch.Tensor | None:
        """The replica's outputs for positions [first, b) of `finding`'s inputs [B, b, H] (with its deep prompts, as
        Petals' rpc_forward takes them) in one rpc_forward; None if it failed (a failed referee is not a liar)."""
        return await self._forward(replica, Chain((replica,)), finding)

    async def chain_answer(
        self, span: RemoteSpanInfo, chain: Chain, finding: Finding, known: Mapping[str, torch.Tensor | None] | None
    ) -> torch.Tensor | None:
        """`answer` of a chain of servers holding `span`'s blocks together (one: that server's `answer`)."""
        if len(chain.hops) == 1:
            return await self.answer(chain.hops[0], finding, known)
        return await self._forward(span, chain, finding)

    async def _forward(self, span: RemoteSpanInfo, chain: Chain, finding: Finding) -> torch.Tensor | None:
        """`finding`'s stretch run hop by hop along `chain` (`chains.chain_forward`); None if a hop failed."""
        prompts = NO_PROMPTS if finding.prompts is None else finding.prompts
        try:
            return (await chain_forward(self.manager, span, chain, finding.inputs, prompts))[:, finding.first :]
        except Exception as e:
            logger.info("stretches.referee_failed(chain=%s, error=%r)", chain.describe(), e)
            return None

    async def answer(
        self, replica: RemoteSpanInfo, finding: Finding, known: Mapping[str, torch.Tensor | None] | None
    ) -> torch.Tensor | None:
        """`recompute`, or the answer `replica` already gave to `finding`'s stretch (`known`: by peer id, None where
        it failed): each replica is asked a stretch once, by `decide` and by the recheck of a ban too (decision 0232)."""
        if known is not None and replica.peer_id in known:
            return known[replica.peer_id]
        return await self.recompute(replica, finding)

    def compare(self, a: torch.Tensor, b: torch.Tensor, spans: tuple[RemoteSpanInfo, ...]) -> tuple[bool, float]:
        """(every position of `a` and `b` [B, T, H] agrees within the tolerance (`output_checks.comparison_rtol`, per
        position), the largest per-position error)."""
        rtol = comparison_rtol(self.manager.config.verify_rtol, spans, a.dtype, b.dtype)
        error = float(position_errors(a, b).max()) if a.numel() else 0.0
        return error <= rtol, error

    async def decide(
        self,
        span: RemoteSpanInfo,
        referee: RemoteSpanInfo,
        recomputed: torch.Tensor,
        finding: Finding,
        thirds: list[RemoteSpanInfo] | None = None,
        known: Mapping[str, torch.Tensor | None] | None = None,
    ) -> Verdict:
        """`referee` answered `recomputed` [B, b - first, H] where `span`'s server claimed `finding.claimed`: further
        replicas (`thirds`, default: every other) recompute the stretch until one sides with either. The one
        outvoted 2:1 is banned for good ("caught": the server; "referee_lied") where a witness has standing and no
        replica outside the three refutes them (`recheck`, decision 0208), else avoided ("disputed",
        "referee_disputed"); with no third, "undecided": nobody is banned. Replicas in `known` (by peer id) answered
        the stretch already (`answer`): neither a third nor the recheck asks them again."""
        logger.warning(
            "stretches.disagreement(blocks=%d:%d, server=...%s, referee=...%s, positions=%d:%d, max_error=%.3g)",
            span.start, span.end, span.peer_id[-6:], referee.peer_id[-6:], finding.first, finding.inputs.shape[1],
            finding.max_error,
        )  # fmt: skip
        if thirds is None:
            thirds = self.replicas(span, {span.peer_id, referee.peer_id})
        for third in thirds:
            decided = await self.answer(third, finding, known)
            if decided is None:
                continue
            where = f"blocks {span.start}:{span.end}, positions {finding.first}:{finding.inputs.shape[1]}"
            if self.compare(decided, recomputed, (third, referee))[0]:  # two replicas outvote the server
                rechecked = await self.recheck(span, finding, (referee, third), recomputed, span, known)
                banned = outvote(
                    self.manager, span.peer_id, [referee.peer_id, third.peer_id], where, rechecked=rechecked
                )
                return "caught" if banned else "disputed"
            if self.compare(decided, finding.claimed, (third, span))[0]:  # the first referee lied
                rechecked = await self.recheck(span, finding, (span, third), finding.claimed, referee, known)
                banned = outvote(
                    self.manager, referee.peer_id, [span.peer_id, third.peer_id], where, rechecked=rechecked
                )
                return "referee_lied" if banned else "referee_disputed"
        logger.warning(
            "stretches.undecided(blocks=%d:%d, server=...%s, referee=...%s): no third replica; nobody banned",
            span.start, span.end, span.peer_id[-6:], referee.peer_id[-6:],
        )  # fmt: skip
        return "undecided"

"""Who may get a server banned on the word of others (decisions 0190, 0208). Two servers that agree with each other
and not with a third outvote it 2:1 (a race's pair against the left server, 0183; referees against a verified server,
`step_verifier`; replicas against a shadowed server or an upstream, `stretches`). Peer ids cost nothing, so the
outvoted server is banned for good (and may be the subject of a shared finding) only where a witness has standing
with this client: `witness_standing_steps` verified outputs in a row that agreed with another server
(`BanList.agreed_in_a_row`: reset by any disagreement, never earned from a co-witness of an open dispute nor by a race
pair's agreement with each other). Short of it, the accused is avoided for `DISPUTE_AVOID_S` (never banned, never in
a finding) and the witnesses are watched for `WATCH_S` (`routing.disputes`): each of their steps is verified, by
other referees first.

Standing is not lent (0208): before a ban carried by standing, servers outside the dispute recompute the same request
(`recheck`; whole holders, or chains of them run as a route: 0234, `chains`). "refuted" (none confirms the
witnesses): a tie, nobody banned, every party avoided, the witnesses' standing lost. "split": nobody banned, the
accused avoided and the witnesses watched, nobody's standing lost. "confirmed" or "unchecked" (none answered): banned,
except where the ban would rest on one standing while an outsider asked did not answer (0232: the framers may have
kept it busy) or a sub-span is held outside by nobody (0234). A ban resting on one standing (no second witness nor
confirming outsider with standing) spends it; one resting on two or more spends nothing (0226: else free identities
would drain honest servers' standing, one throwaway lie each).

A server that loses dispute after dispute is avoided longer each time (0225, `routing.dispute_repeats`): 300 s
doubled per dispute lost, capped at a day, never further than each witness has accused before, only once servers
outside did not refute the witnesses, forgotten after a long honest record; refuted witnesses lose the dispute
themselves."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from corolla.client.routing.dispute_repeats import DISPUTE_AVOID_S, REPEATS_FORGIVEN_STEPS
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.verification.chains import Chain, Outsiders
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

WATCH_S = DISPUTE_AVOID_S  # the witnesses' steps are verified this long

Recheck = Literal["confirmed", "refuted", "split", "unchecked"]  # what servers outside a dispute recomputed


@dataclass(frozen=True)
class Rechecked:
    """What servers outside a dispute said (`recheck`): the verdict, and which of them confirmed the witnesses (the
    peer ids of each server, or chain of servers, that did: one whose every server has standing is a second standing
    under the ban, which then spends none, decision 0226)."""

    verdict: Recheck
    confirmed_by: tuple[tuple[str, ...], ...] = ()
    # outsiders asked that did not answer (failed, refused, timed out), and a span held outside only in part with no
    # chain of outside servers over it (`Outsiders.unheard`, decision 0234)
    silent: int = 0


UNCHECKED = Rechecked("unchecked")  # nobody outside was asked, or none answered

# servers outside a dispute asked at most, at once (decision 0220): one honest one among them keeps a made-up answer
# out, so m free identities against n honest servers fill every seat about (m / (m + n)) ** 8 of the time; each is
# one stateless forward, asked only where a fresh race pair forms or a ban would rest on a standing (0208)
OUTSIDERS_MAX = 8
# chains asked beside them, those of the longest record of verified work with this client not seated already
# (`StretchReferees.outsiders`, decision 0246): at most 4 more forwards per recheck
RECORD_SEATS = 4


def trusted(manager: RemoteSequenceManager, peer_id: str) -> bool:
    """Whether `peer_id` has a witness's standing with this client."""
    return manager.bans.agreed_in_a_row(peer_id) >= manager.config.witness_standing_steps


def needs_recheck(manager: RemoteSequenceManager, accused: str, witnesses: Sequence[str]) -> bool:
    """Whether an outvote of `accused` by `witnesses` would ban on standing, or avoid past the first avoidance
    (decision 0225): only then is an outside server asked first (never at `witness_standing_steps` 0: main's rule for
    a swarm whose identities are not free, any two ban)."""
    steps = manager.config.witness_standing_steps
    return steps > 0 and (
        any(trusted(manager, peer) for peer in witnesses) or manager.repeats.level(accused, witnesses) > 0
    )


def refuted(manager: RemoteSequenceManager, peer_id: str) -> None:
    """Servers outside a dispute sided against `peer_id`, a witness: its standing lost, and it is avoided as the
    loser of the dispute, longer each time (`DisputeRepeats.refuted`, decision 0225)."""
    manager.bans.record_verified(peer_id, agreed=False)
    manager.avoid(peer_id, manager.repeats.refuted(peer_id))


async def recheck(outsiders: Outsiders, confirms: Callable[[Chain], Awaitable[bool | None]]) -> Rechecked:
    """Asks every chain of `outsiders` (`StretchReferees.outsiders`) at once whether it confirms the witnesses'
    outputs (`confirms(chain)`: the disputed request recomputed and compared; None where it failed: no liar, not
    counted): "confirmed" where every one that answered does, "refuted" where none does, "split" where they differ,
    "unchecked" where none answered; with the peers that confirmed."""
    asked = outsiders.chains
    try:
        answers = await asyncio.gather(*map(confirms, asked))
    finally:  # (a hop the chains share, still running for a chain past its deadline: decision 0237)
        if outsiders.answers is not None:
            outsiders.answers.close()
    answered = [(chain.peer_ids, answer) for chain, answer in zip(asked, answers, strict=True) if answer is not None]
    silent = len(asked) - len(answered) + outsiders.unheard
    if not answered:
        return Rechecked("unchecked", silent=silent)
    confirmed_by = tuple(peer for peer, answer in answered if answer)
    if len(confirmed_by) == len(answered):
        return Rechecked("confirmed", confirmed_by, silent)
    return Rechecked("split" if confirmed_by else "refuted", confirmed_by, silent)


def outvote(
    manager: RemoteSequenceManager, accused: str, witnesses: Sequence[str], reason: str, *, rechecked: Rechecked
) -> bool:
    """`witnesses` (two servers that agree with each other) outvoted `accused`'s outputs: banned for good (and
    dropped from the view), avoided with the witnesses watched, or, "refuted", every party avoided, by the module's
    rules on `rechecked` and the standings it would rest on. Returns whether it was banned."""
    standing = [peer for peer in witnesses if trusted(manager, peer)]
    # the standings a ban would rest on: the witnesses' and the confirming outsiders' (decision 0226); a chain's only
    # where every server of it has standing (one fresh hop may have made up what the chain answered)
    confirming = {peers for peers in rechecked.confirmed_by if all(trusted(manager, peer) for peer in peers)}
    carried = {*((peer,) for peer in standing), *confirming} if standing else set()
    if manager.bans.agreed_in_a_row(accused) >= REPEATS_FORGIVEN_STEPS:  # a long honest record since (0225)
        manager.repeats.forgive(accused)
    manager.bans.record_verified(accused, agreed=False)  # outvoted either way: no witness until it earns it again
    by = ", ".join("..." + peer[-6:] for peer in witnesses)
    avoid_s = DISPUTE_AVOID_S
    if rechecked.verdict == "refuted":  # the outside servers' word against theirs: a tie, the witnesses lose (0225)
        for peer in witnesses:
            refuted(manager, peer)
        manager.repeats.forgive(accused)  # its earlier disputes lost are in doubt too: it was framed, or none was
        why = "no server outside them confirmed: nobody banned, every party avoided"
    elif rechecked.verdict == "split":  # either side may be an attacker's: counted, not escalated
        avoid_s = manager.repeats.outvoted(accused, witnesses, escalate=False)
        why = "the servers outside them split: not banned, the witnesses watched"
    elif len(carried) == 1 and rechecked.silent:
        # one standing, and an outsider asked did not answer: its word may be the honest side's, kept busy by the
        # framers when they framed (decision 0232); two standings ban whoever was silent (0226's rule)
        avoid_s = manager.repeats.outvoted(accused, witnesses, escalate=False)
        why = (
            "it would rest on one standing and a server outside them did not answer: not banned, the witnesses watched"
        )
    elif standing:
        logger.warning(
            "witnesses.liar_banned(peer=...%s, by=%s, %s, standings=%d): %s",
            accused[-6:], by, rechecked.verdict, len(carried), reason,
        )  # fmt: skip
        manager.bans.ban_liar(accused)
        manager.on_request_failure(accused)
        # resting on one standing, the ban spends it: one ban per standing earned, never lent to one fresh partner
        # after another (0208); on two or more it spends none, as against a real liar: else each free identity that
        # lies once and is outvoted by two honest servers would drain their standing until no liar could be banned
        if len(carried) < 2:
            for peer in standing:
                manager.bans.record_verified(peer, agreed=False)
        return True
    else:
        avoid_s = manager.repeats.outvoted(accused, witnesses, escalate=True)
        why = "short of a witness's standing: not banned, the witnesses watched"
    avoided = manager.avoid(accused, avoid_s)
    manager.disputes.open(accused, witnesses, WATCH_S)
    logger.warning(
        "witnesses.disputed(peer=...%s, by=%s, avoided=%s, avoid_s=%.0f): %s; %s",
        accused[-6:], by, avoided, avoid_s, reason, why,
    )  # fmt: skip
    return False

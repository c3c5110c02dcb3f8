"""Re-verifying a finding received from someone else, first-hand (`check_finding`), so that a liar cannot use a
shared finding to frame an honest server. A finding is hearsay (nothing proves the accused sent its claimed outputs:
servers do not sign them), so the receiver asks the swarm itself:
1. a replica of the accused's blocks other than the accused and the reporter recomputes the finding's inputs (with
   its deep prompts) in one `rpc_forward`; none answers: "unverifiable";
2. the claim matches that recomputation: "refuted" (the claimed outputs are right: the reporter lied or erred);
3. the accused is asked the same inputs itself; it is gone, fails, or answers as the replica did: "unverifiable"
   (the claim cannot be confirmed first-hand; a liar that lies rarely lands here too);
4. its own answer differs from the replica's: further replicas (never the reporter) decide 2:1
   (`StretchReferees.decide`, the rule shadows use): the accused outvoted by two replicas with a witness's standing
   is banned for good and its own answer kept as this client's first-hand finding (`FindingStore.record_caught`):
   "caught"; outvoted by replicas short of standing (only avoided, decision 0190), the replica outvoted by the
   accused and a third banned instead, or no third answering: "unverifiable" for the accused.
Only "caught" changes anything about the accused; a forged finding against an honest server ends in 2 or 3. A finding
against a server this client has banned as a liar already is not re-checked ("unverifiable")."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Literal

from corolla.client.routing.findings import Finding
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.verification.stretches import StretchReferees
from corolla.protocol.records import RemoteSpanInfo, ServerInfo, ServerState
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

Verdict = Literal["refuted", "caught", "unverifiable"]


async def check_finding(manager: RemoteSequenceManager, finding: Finding, *, reporter: str | None = None) -> Verdict:
    """Re-verifies `finding` first-hand (module docstring). `reporter`: the peer that sent it, never asked."""
    if manager.bans.is_liar(finding.peer_id):  # (out of the view: it could not be asked)
        return _unverifiable(finding, "this client banned it as a liar already")
    referees = StretchReferees(manager)
    accused = next((s for s in manager.spans if s.peer_id == finding.peer_id), None)
    span = RemoteSpanInfo(
        peer_id=finding.peer_id,
        start=finding.blocks[0],
        end=finding.blocks[1],
        server_info=accused.server_info if accused is not None else ServerInfo(ServerState.ONLINE, 1.0),
    )
    excluded = {finding.peer_id} | ({reporter} if reporter else set())
    reference, replica = None, None
    for candidate in referees.replicas(span, excluded):
        reference = await referees.recompute(candidate, finding)
        if reference is not None:
            replica = candidate
            break
    if reference is None or replica is None:
        return _unverifiable(finding, "no replica of its blocks answered")
    if referees.compare(finding.claimed, reference, (span, replica))[0]:
        logger.warning(
            "findings.refuted(accused=...%s, reporter=%s): its claimed outputs are right",
            finding.peer_id[-6:],
            reporter,
        )
        return "refuted"
    if accused is None:
        return _unverifiable(finding, "the accused serves none of these blocks now")
    own = await referees.recompute(span, finding)  # the accused, asked by us
    if own is None:
        return _unverifiable(finding, "the accused did not answer")
    if referees.compare(own, reference, (span, replica))[0]:
        return _unverifiable(finding, "its own answer is right")
    own_finding = dataclasses.replace(finding, claimed=own)
    thirds = referees.replicas(span, excluded | {replica.peer_id})
    verdict = await referees.decide(span, replica, reference, own_finding, thirds)
    if verdict == "referee_lied":  # the replica lied to us, outvoted by the accused and a third: first-hand too
        replica_finding = dataclasses.replace(finding, peer_id=replica.peer_id, claimed=reference)
        await asyncio.to_thread(manager.findings.record_caught, replica_finding)
    if verdict == "disputed":  # (decision 0190)
        return _unverifiable(finding, "outvoted by replicas short of a witness's standing: avoided, not banned")
    if verdict != "caught":
        return _unverifiable(finding, "no second replica sided with the first")
    await asyncio.to_thread(manager.findings.record_caught, own_finding)  # (disk: off the client loop)
    return "caught"


def _unverifiable(finding: Finding, reason: str) -> Verdict:
    logger.warning("findings.unverifiable(accused=...%s): %s; nothing changes", finding.peer_id[-6:], reason)
    return "unverifiable"

"""Deciding whether a server's claimed outputs for a stretch of a span's session are wrong (`StretchReferees`): a
replica of the span recomputes the stretch as ONE stateless `rpc_forward` over the span's inputs for positions
[0, b) and its session's deep prompts, if any (an existing RPC, so stock Petals servers serve as referees and are checked too), and the outputs the server
claimed for positions [first, b) are compared position by position within the dtype's tolerance. A disagreement is
decided by a second replica: the server outvoted 2:1 is banned for good (`BanList.ban_liar`); with no second replica
nobody is banned (an honest server must never be banned because one referee lied), and the finding is kept.

Who asks: `client.session.shadows` (a sampled session's replica disagreed with its server: the shadow's outputs are the first
referee's answer) and `client.verification.finding_check` (a shared finding, re-verified first-hand). Sessions are no longer verified
by sampling stretches of them here: recomputing [0, b) from position 0 for each stretch cost a busy card 93-125% of
its decode time, against the spare rows of a shadow session (docs/decisions/0042-shadow-sessions-built.md)."""

from __future__ import annotations

import random
from typing import Literal

import torch

from corolla.client.calls.output_checks import comparison_rtol
from corolla.client.calls.remote_forward_backward import NO_PROMPTS, run_remote_forward
from corolla.client.routing.findings import Finding
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.protocol.records import RemoteSpanInfo
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


def position_errors(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Relative L2 error per position of `a`, `b` [B, T, H] -> [B, T] (float32; 0 where both are zero)."""
    a32, b32 = a.float(), b.float()
    scale = torch.maximum(a32.norm(dim=-1), b32.norm(dim=-1)).clamp_min(1e-12)
    return (a32 - b32).norm(dim=-1) / scale


Verdict = Literal["agreed", "caught", "undecided", "referee_lied"]


class StretchReferees:
    """Replicas of a span, asked to recompute a stretch of its session and outvote a wrong answer 2:1."""

    def __init__(self, manager: RemoteSequenceManager, *, rng: random.Random | None = None):
        self.manager = manager
        self.rng = rng or random.Random()

    def replicas(self, span: RemoteSpanInfo, exclude: set[str]) -> list[RemoteSpanInfo]:
        """Unbanned servers holding all of `span`'s blocks, not in `exclude`, in random order, as spans of them."""
        banned = self.manager.bans.banned_peers()
        others = [
            RemoteSpanInfo(peer_id=s.peer_id, start=span.start, end=span.end, server_info=s.server_info)
            for s in self.manager.spans
            if s.peer_id not in exclude and s.peer_id not in banned and s.start <= span.start and span.end <= s.end
        ]
        self.rng.shuffle(others)
        return others

    async def recompute(self, replica: RemoteSpanInfo, finding: Finding) -> torch.Tensor | None:
        """The replica's outputs for positions [first, b) of `finding`'s inputs [B, b, H] (with its deep prompts, as
        Petals' rpc_forward takes them) in one rpc_forward; None if it failed (a failed referee is not a liar)."""
        prompts = NO_PROMPTS if finding.prompts is None else finding.prompts
        try:
            return (await run_remote_forward(self.manager, replica, finding.inputs, prompts))[:, finding.first :]
        except Exception as e:
            logger.info("stretches.replica_failed(peer=...%s, error=%r)", replica.peer_id[-6:], e)
            return None

    def compare(self, a: torch.Tensor, b: torch.Tensor, spans: tuple[RemoteSpanInfo, ...]) -> tuple[bool, float]:
        """(every position of `a` and `b` [B, T, H] agrees within the tolerance (`output_checks.comparison_rtol`, per
        position), the largest per-position error)."""
        rtol = comparison_rtol(self.manager.config.verify_rtol, spans, a.dtype, b.dtype)
        error = float(position_errors(a, b).max()) if a.numel() else 0.0
        return error <= rtol, error

    async def verify(self, span: RemoteSpanInfo, finding: Finding) -> Verdict:
        """Asks replicas of `span` (not its server) to recompute `finding`'s inputs: "agreed" (the first that
        answers agrees with the claim), else `decide` with it; "undecided" where none answers."""
        referees = self.replicas(span, {span.peer_id})
        for index, referee in enumerate(referees):
            recomputed = await self.recompute(referee, finding)
            if recomputed is None:
                continue
            agrees, error = self.compare(finding.claimed, recomputed, (span, referee))
            if agrees:
                return "agreed"
            return await self.decide(span, referee, recomputed, finding, referees[index + 1 :])
        return "undecided"

    async def decide(
        self,
        span: RemoteSpanInfo,
        referee: RemoteSpanInfo,
        recomputed: torch.Tensor,
        finding: Finding,
        thirds: list[RemoteSpanInfo] | None = None,
    ) -> Verdict:
        """`referee` answered `recomputed` [B, b - first, H] where `span`'s server claimed `finding.claimed`: further
        replicas (`thirds`, default: every other) recompute the stretch until one sides with either. The one
        outvoted 2:1 is banned for good ("caught": the server; "referee_lied"); with no third, "undecided":
        nobody is banned."""
        logger.warning(
            "stretches.disagreement(blocks=%d:%d, server=...%s, referee=...%s, positions=%d:%d, max_error=%.3g)",
            span.start, span.end, span.peer_id[-6:], referee.peer_id[-6:], finding.first, finding.inputs.shape[1],
            finding.max_error,
        )  # fmt: skip
        if thirds is None:
            thirds = self.replicas(span, {span.peer_id, referee.peer_id})
        for third in thirds:
            decided = await self.recompute(third, finding)
            if decided is None:
                continue
            if self.compare(decided, recomputed, (third, referee))[0]:  # two replicas outvote the server
                self._ban_liar(span.peer_id, span, f"outvoted by ...{referee.peer_id[-6:]}, ...{third.peer_id[-6:]}")
                return "caught"
            if self.compare(decided, finding.claimed, (third, span))[0]:  # the first referee lied
                self._ban_liar(referee.peer_id, span, f"outvoted by ...{span.peer_id[-6:]}, ...{third.peer_id[-6:]}")
                return "referee_lied"
        logger.warning(
            "stretches.undecided(blocks=%d:%d, server=...%s, referee=...%s): no third replica; nobody banned",
            span.start, span.end, span.peer_id[-6:], referee.peer_id[-6:],
        )  # fmt: skip
        return "undecided"

    def _ban_liar(self, peer_id: str, span: RemoteSpanInfo, reason: str) -> None:
        logger.warning(
            "stretches.liar_banned(peer=...%s, blocks=%d:%d): %s", peer_id[-6:], span.start, span.end, reason
        )
        self.manager.bans.ban_liar(peer_id)
        self.manager.on_request_failure(peer_id)

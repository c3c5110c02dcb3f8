"""Whether a race's pair may rebuild a session from its outputs (decision 0190, "Attacked"). Two racers that agree
with each other and not with the left server's earlier outputs outvote it (0183), and their trial's outputs replace
the left server's in what the session built from them; one attacker's two fresh identities racing first with the
same made-up outputs would turn every later token wrong. So servers outside the pair and the accused recompute the
trial statelessly (`rpc_forward`), up to `witnesses.OUTSIDERS_MAX` at once, those with a witness's standing first,
the rest at random, and every one that answered must agree (a referee may be a third identity of the attacker, 0220):
"confirmed" where all agree, "refuted" where all disagree (both avoided), "split" where they differ (the pair does not
win, nobody is avoided), "unchecked" where none answered (the pair's word stands, and it is watched). A pair with a
witness's standing is refereed so too (its standing is not lent, 0208): the asking is `witnesses.recheck`."""

from __future__ import annotations

import random

import torch

from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.verification.chains import Chain, chain_forward
from corolla.client.verification.stretches import StretchReferees
from corolla.client.verification.witnesses import Rechecked, recheck
from corolla.protocol.records import RemoteSpanInfo
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


async def referee_pair(
    manager: RemoteSequenceManager,
    span: RemoteSpanInfo,
    inputs: torch.Tensor,
    prompts: torch.Tensor,
    claimed: torch.Tensor,
    exclude: set[str],
    rng: random.Random,
) -> Rechecked:
    """Has servers of `span`'s blocks (not banned, not in `exclude`: the pair and the accused; in
    `StretchReferees.outsiders`' order) recompute the trial's `inputs` [B, n, H] (with `prompts`, the trial's deep
    prompts) at once (`witnesses.recheck`) and compares their outputs at the first m positions with the pair's
    `claimed` [B, m <= n, H], position by position (the verification's tolerance)."""
    referees = StretchReferees(manager, rng=rng)

    async def confirms(referee: Chain) -> bool | None:
        """Whether `referee`'s recompute (a server's, or a chain's of servers holding the blocks together: decision
        0234) agrees with the pair; None where it failed (not a liar: not counted)."""
        try:
            recomputed = (await chain_forward(manager, span, referee, inputs, prompts))[:, : claimed.shape[1]]
        except Exception as e:
            logger.info("pair_referee.referee_failed(chain=%s, error=%r)", referee.describe(), e)
            return None
        agrees, error = referees.compare(claimed, recomputed, (span, *referee.hops))
        logger.info(
            "pair_referee.recomputed(blocks=%d:%d, referee=%s, agrees=%s, rel_error=%.3g)",
            span.start, span.end, referee.describe(), agrees, error,
        )  # fmt: skip
        return agrees

    return await recheck(referees.outsiders(span, exclude), confirms)

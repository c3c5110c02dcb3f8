"""Whose fault are a span's outputs that the next span's float16 server cannot hold (decision 0186)?

A model may write values past float16's range into its residual stream: the float16 server is then routed around and
nobody is blamed (0170). A hostile upstream can write them too, to get an honest float16 server avoided, so before
that the client has replicas of the upstream's span recompute the step (`StretchReferees`, up to
`witnesses.OUTSIDERS_MAX` at once):
- "honest": every replica that answered agrees: the model's own range; the float16 server is routed around.
- "caught": every one disagrees and two with a witness's standing outvote the upstream: banned for good
  (`StretchReferees.decide`).
- "disputed": the replicas split (0228, 0220's rule), or all disagree and no third decides, or two short of standing
  outvote it (0190): the upstream is avoided instead of the float16 server; nobody is banned.
- "unchecked": no replica answered: 0170's rule.
Where a replica confirms the upstream, its own inputs may have carried the values (a liar further up, honest wider
servers between), so the span before it is asked next, and so on back (`producer_failure`). It runs only for a step
refused this way, by inference sessions and training's forward calls."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch

from corolla.client.calls.output_checks import BadServerOutput, InputsOutOfRange
from corolla.client.routing.findings import Finding
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.verification.stretches import StretchReferees
from corolla.client.verification.witnesses import OUTSIDERS_MAX
from corolla.protocol.records import RemoteSpanInfo
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

RangeVerdict = Literal["honest", "caught", "disputed", "unchecked"]


async def judge_producer(
    manager: RemoteSequenceManager,
    span: RemoteSpanInfo,
    inputs: torch.Tensor,
    claimed: torch.Tensor,
    prompts: torch.Tensor | None = None,
) -> RangeVerdict:
    """`span`'s server answered `claimed` [B, m, H] (its outputs for positions [n - m, n)) for its inputs `inputs`
    [B, n, H] (and deep prompts `prompts` [blocks, B|1, P, H] or None), values the next span's server cannot hold:
    the verdict of its replicas (see the module docstring)."""
    referees = StretchReferees(manager)
    replicas = referees.replicas(span, {span.peer_id})[:OUTSIDERS_MAX]
    first = inputs.shape[1] - claimed.shape[1]
    asked = Finding(span.peer_id, (span.start, span.end), inputs, claimed, first, prompts)
    # every replica at once, the upstream's values the model's own only where all that answered agree (decision
    # 0228, 0220's rule): one by one, the first that agreed (an attacker's second identity of the span) decided, or it
    # outvoted an honest one with the upstream as a third, and the lie went on through a wider server
    recomputed = await asyncio.gather(*(referees.recompute(replica, asked) for replica in replicas))
    answered = [(replica, theirs) for replica, theirs in zip(replicas, recomputed, strict=True) if theirs is not None]
    if not answered:  # (failed referees, a float16 one that cannot hold the inputs too, are no liars)
        return "unchecked"
    comparisons = [referees.compare(claimed, theirs, (span, replica)) for replica, theirs in answered]
    dissent = [
        (replica, theirs, error)
        for (replica, theirs), (agrees, error) in zip(answered, comparisons, strict=True)
        if not agrees
    ]
    error = max(error for _, error in comparisons)
    verdict: RangeVerdict = "honest"
    if dissent and len(dissent) < len(answered):  # a split: one side may be an attacker's identities; not used
        verdict = "disputed"
    elif dissent:
        referee, theirs, error = dissent[0]
        finding = Finding(span.peer_id, (span.start, span.end), inputs, claimed, first, prompts, error)
        thirds = [replica for replica, _ in answered if replica is not referee]
        # (the answers held decide, the recheck of a ban included: each replica asked once, decision 0232)
        known = {replica.peer_id: answer for replica, answer in zip(replicas, recomputed, strict=True)}
        decided = await referees.decide(span, referee, theirs, finding, thirds, known)
        # (replicas short of a witness's standing outvoted it, or nobody decided: "disputed", avoided only, decision
        # 0190; every replica that answered disagreed, so a third siding with the upstream is no longer seen here)
        verdict = "caught" if decided == "caught" else "disputed"
    logger.info(
        "range_dispute.verdict(blocks=%d:%d, peer=...%s, replicas=%d, disagreeing=%d, verdict=%s, max_error=%.3g)",
        span.start, span.end, span.peer_id[-6:], len(answered), len(dissent), verdict, error,
    )  # fmt: skip
    return verdict


class Produced(NamedTuple):
    """A span's step as the client holds it: `span`'s server answered `outputs` [B, m, H] (positions [n - m, n)) for
    `inputs` [B, n, H] (and deep prompts `prompts` [blocks, B|1, P, H] or None)."""

    span: RemoteSpanInfo
    inputs: torch.Tensor
    outputs: torch.Tensor
    prompts: torch.Tensor | None


async def producer_failure(
    manager: RemoteSequenceManager, producers: Sequence[Produced], refused: InputsOutOfRange
) -> tuple[int, ConnectionError] | None:
    """The next span's server refused the outputs of `producers[0]` (the spans before it in this step, nearest
    first) as past its range (`refused`, nothing sent). Each is put to a replica in turn while one agrees with it:
    an honest span's outputs are the model's function of its inputs, so outputs past the range may come from values
    an earlier span wrote into them (a liar two spans up, its values carried on by the residual stream of an honest
    span between) and that span is asked next. None where every one of them is confirmed, or one cannot be checked
    (the float16 server is routed around, decision 0170); else (its index in `producers`, the failure of its server
    in the float16 server's place): `InputsOutOfRange` of it (avoided) where a replica disputes its outputs,
    `BadServerOutput` (`taints_history`; banned for good already) where replicas outvote it."""
    for index, produced in enumerate(producers):
        verdict = await judge_producer(manager, produced.span, produced.inputs, produced.outputs, produced.prompts)
        led = f"({refused})" if index == 0 else f"(they led {index} span(s) on to {refused})"
        if verdict == "caught":
            return index, BadServerOutput(
                produced.span.peer_id, f"outputs outvoted by replicas {led}", taints_history=True
            )
        if verdict == "disputed":
            return index, InputsOutOfRange(produced.span.peer_id, f"outputs disputed by a replica {led}")
        if verdict == "unchecked":
            return None
    return None

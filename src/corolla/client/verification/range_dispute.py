"""Whose fault are a span's outputs that the next span's float16 server cannot hold (decision 0186)?

A float32 or bfloat16 model may write values past float16's +-65504 into its residual stream (some models'
outlier activations do): then the float16 server of the next span is routed around and nobody is blamed (decision
0170). A hostile upstream can write such values too, and was then free to have the honest float16 server avoided for
`retries.RANGE_AVOID_S` by every client it served, its own outputs (a lie) going on through a wider server. So the
client asks a replica of the upstream's span to recompute the step (`StretchReferees`: one stateless rpc_forward
over the span's inputs), before it routes around the float16 server:
- "honest": a replica agrees with the values (or outvotes a referee that did not): the model's own range; the float16
  server is routed around as before.
- "caught": two replicas with a witness's standing outvote the upstream: banned for good (`StretchReferees.decide`).
- "disputed": one replica disagrees and no third decides, or two short of standing outvote it (decision 0190): the
  upstream is avoided instead of the float16 server (nobody is banned). Either way one server is avoided for a while; this way the one whose answer nothing confirmed.
- "unchecked": no replica answered (the upstream is the only server of its span): decision 0170 as it was.
Where a replica confirms the upstream, its inputs may be what carried the values (a liar two spans before the float16
server, an honest wider server between: the residual stream keeps them): the span before it is asked next, and so on
back (`producer_failure`, hrev12's review of 0186). The check runs once a step is refused this way (no cost on any
other step); the float16 server is then avoided or the upstream is, so the next steps do not ask again. Inference sessions (`InferenceSession._step`) and training's
forward calls (`remote_sequential.sequential_forward`) ask it (`producer_failure`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch

from corolla.client.calls.output_checks import BadServerOutput, InputsOutOfRange
from corolla.client.routing.findings import Finding
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.verification.stretches import StretchReferees
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
    replicas = referees.replicas(span, {span.peer_id})
    first = inputs.shape[1] - claimed.shape[1]
    asked = Finding(span.peer_id, (span.start, span.end), inputs, claimed, first, prompts)
    for index, referee in enumerate(replicas):
        recomputed = await referees.recompute(referee, asked)
        if recomputed is None:  # a failed referee (a float16 one that cannot hold the inputs too) is not a liar
            continue
        agrees, error = referees.compare(claimed, recomputed, (span, referee))
        if agrees:
            verdict: RangeVerdict = "honest"
        else:
            finding = Finding(span.peer_id, (span.start, span.end), inputs, claimed, first, prompts, error)
            decided = await referees.decide(span, referee, recomputed, finding, replicas[index + 1 :])
            # (a third sided with the upstream: "honest"; replicas short of a witness's standing outvoted it, or
            # nobody decided: "disputed", avoided only, decision 0190)
            sided = decided in ("referee_lied", "referee_disputed")
            verdict = "caught" if decided == "caught" else "honest" if sided else "disputed"
        logger.info(
            "range_dispute.verdict(blocks=%d:%d, peer=...%s, referee=...%s, verdict=%s, max_error=%.3g)",
            span.start, span.end, span.peer_id[-6:], referee.peer_id[-6:], verdict, error,
        )  # fmt: skip
        return verdict
    return "unchecked"


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

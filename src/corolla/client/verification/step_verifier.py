"""`StepVerifier`: re-runs a sampled fraction of inference steps on other servers of the same span (a stateless
`rpc_forward` over the span's recorded inputs) and compares the new positions; training's forward and backward calls
(`remote_sequential`) are sampled and voted on the same way. A server outvoted 2:1 is banned for good where a witness
has standing and no server outside them, asked first, refutes them (decision 0208), else avoided and the witnesses
watched: a watched server's every step is verified, whatever the fraction (`sample(peers)`, 0190). Two servers that
disagree with no third to decide are both banned. A span with one server cannot be checked: at `verify_fraction` < 1
its outputs are trusted (sampling deters); at 1.0 only from a server whose last `LONE_TRUST_STEPS` verified outputs
all agreed with others (a liar on 10% of its steps builds that record with probability 0.1%), else the call fails
with `UnverifiableOutput`, which bans nobody: the client waits (within `max_wait_s`) for a second server."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Iterable, Sequence

import torch

from corolla.client.calls.output_checks import (
    BadServerOutput,
    InputsOutOfRange,
    OutputsDisputed,
    comparison_rtol,
    relative_error,
)
from corolla.client.calls.remote_forward_backward import NO_PROMPTS
from corolla.client.routing.dispute_repeats import DISPUTE_AVOID_S
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.verification.chains import Chain, chain_backward, chain_forward
from corolla.client.verification.stretches import StretchReferees
from corolla.client.verification.witnesses import UNCHECKED, Rechecked, needs_recheck, outvote, recheck
from corolla.protocol.records import RemoteSpanInfo
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

LONE_TRUST_STEPS = 64  # verified outputs in a row that agreed with other servers: trusted when no other is left


class UnverifiableOutput(ConnectionError):
    """At `verify_fraction` 1.0, no other server holds the span's blocks to check its server's outputs."""

    def __init__(self, peer_id: str, blocks: tuple[int, int]):
        self.peer_id = peer_id
        super().__init__(
            f"server ...{peer_id[-6:]} is the only server of blocks {blocks[0]}:{blocks[1]}: its outputs cannot be "
            f"verified (verify_fraction=1.0 waits for a second server)"
        )


class StepVerifier:
    """Per inference session: `sample()` decides if a step is verified; `await verify(span, inputs, outputs, ...)`
    raises BadServerOutput (`taints_history`) for the span's server when other servers outvote it."""

    def __init__(self, manager: RemoteSequenceManager, *, rng: random.Random | None = None):
        self.manager = manager
        self.rng = rng or random.Random()
        self.num_verified = 0  # span steps compared with at least one other server
        self.num_rejected = 0  # span steps whose server was outvoted or could not be told from a disagreeing one
        self._lone_spans_logged: set[tuple[int, int]] = set()

    @property
    def fraction(self) -> float:
        return self.manager.config.verify_fraction

    def sample(self, peers: Iterable[str] = ()) -> bool:
        """Whether to verify a step served by `peers`: a watched one always (decision 0190), else a `fraction`."""
        if self.fraction > 0 and (self.fraction >= 1 or self.rng.random() < self.fraction):
            return True
        return self.watches(peers)

    def watches(self, peers: Iterable[str]) -> bool:
        """Whether any of `peers` is watched (`routing.disputes`): its steps are verified whatever the fraction."""
        watched = self.manager.disputes.watched()
        return bool(watched) and any(peer in watched for peer in peers)

    def _agree(
        self, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], spans: tuple[RemoteSpanInfo, ...]
    ) -> tuple[bool, float]:
        """Whether each tensor of `a` matches its counterpart in `b` (relative error within the tolerance); the
        largest error."""
        if len(a) != len(b):
            return False, float("inf")
        rtol = comparison_rtol(self.manager.config.verify_rtol, spans, a[0].dtype, b[0].dtype)
        error = max(relative_error(x, y) for x, y in zip(a, b, strict=True))
        return error <= rtol, error

    async def verify(
        self, span: RemoteSpanInfo, inputs: torch.Tensor, outputs: torch.Tensor, *, prompts: torch.Tensor = NO_PROMPTS
    ) -> None:
        """`inputs` [B, n, H]: the span's inputs for positions [0, n); `outputs` [B, m, H] (as the server sent them):
        its claimed outputs for positions [n - m, n)."""
        num_new = outputs.shape[1]

        async def ask(referee: Chain) -> tuple[torch.Tensor, ...]:
            outputs = await chain_forward(self.manager, span, referee, inputs, prompts)
            return (outputs[:, inputs.shape[1] - num_new :],)

        await self._vote(span, (outputs,), ask, "outputs")

    async def verify_backward(
        self,
        span: RemoteSpanInfo,
        inputs: torch.Tensor,
        grad_outputs: torch.Tensor,
        grad_inputs: torch.Tensor,
        grad_prompts: torch.Tensor | None,
        *,
        prompts: torch.Tensor = NO_PROMPTS,
    ) -> None:
        """A training step's backward: the gradients wrt inputs [B, T, H] and deep prompts (or None) claimed by the
        span's server for `inputs` and `grad_outputs` [B, T, H]; each is compared on its own."""
        claimed = (grad_inputs,) if grad_prompts is None else (grad_inputs, grad_prompts)

        async def ask(referee: Chain) -> tuple[torch.Tensor, ...]:
            grads, other_prompts = await chain_backward(self.manager, span, referee, inputs, grad_outputs, prompts)
            return (grads,) if other_prompts is None else (grads, other_prompts)

        await self._vote(span, claimed, ask, "gradients")

    async def _vote(
        self,
        span: RemoteSpanInfo,
        claimed: tuple[torch.Tensor, ...],
        ask: Callable[[Chain], Awaitable[tuple[torch.Tensor, ...]]],
        what: str,
    ) -> None:
        """Compares `claimed` with what referees (`ask(Chain((referee,)))`; a recheck's chains of outside servers too,
        decision 0234) compute for the same request; raises
        BadServerOutput for the span's server when outvoted, bans referees that failed or cannot be outvoted."""
        referees = StretchReferees(self.manager, rng=self.rng).replicas(span, {span.peer_id})
        if not referees:
            if self.fraction >= 1 and self.manager.bans.agreed_in_a_row(span.peer_id) < LONE_TRUST_STEPS:
                raise UnverifiableOutput(span.peer_id, (span.start, span.end))
            if (span.start, span.end) not in self._lone_spans_logged:
                self._lone_spans_logged.add((span.start, span.end))
                logger.warning(
                    "verification.single_server(blocks=%d:%d, peer=...%s): no other server holds these blocks; "
                    "its outputs are not cross-checked",
                    span.start, span.end, span.peer_id[-6:],
                )  # fmt: skip
            return
        dissent: list[tuple[RemoteSpanInfo, tuple[torch.Tensor, ...]]] = []  # referees that disagreed with the server
        for referee in referees[: self.manager.config.verify_max_referees]:
            try:
                other = await ask(Chain((referee,)))
            except Exception as e:  # the referee failed, not the server under test
                logger.info("verification.referee_failed(peer=...%s, error=%r)", referee.peer_id[-6:], e)
                if not isinstance(e, InputsOutOfRange):  # (nothing was sent: its announced float16, decision 0170)
                    self.manager.on_request_failure(referee.peer_id)
                continue
            agrees, error = self._agree(claimed, other, (span, referee))
            bans = self.manager.bans
            vouching = referee.peer_id in self.manager.disputes.co_witnesses(span.peer_id)
            if agrees and vouching and dissent:
                # a watched server's co-witness against a referee from outside: one witness each (decision 0190)
                self.num_verified += 1
                self.num_rejected += 1
                # not a dispute lost (decision 0228): one referee's word against one, with nothing rechecked; counted
                # as one (0225's `refuted`), a fresh identity's smear cleared the watched server's accusations and
                # doubled its avoidance at each return of the liar it had outvoted. Its standing is lost, as at any
                # disagreement, and it is avoided as the first time
                self.manager.bans.record_verified(span.peer_id, agreed=False)
                self.manager.avoid(span.peer_id, DISPUTE_AVOID_S)
                raise OutputsDisputed(
                    span.peer_id,
                    f"{what} for blocks {span.start}:{span.end} agree only with its co-witness "
                    f"...{referee.peer_id[-6:]}, not with ...{dissent[0][0].peer_id[-6:]}",
                )
            if agrees:
                self.num_verified += 1
                if not vouching:  # (co-witnesses earn no standing from each other: decision 0190)
                    bans.record_verified(span.peer_id, agreed=True)  # outvoting a dissenter too
                    bans.record_verified(referee.peer_id, agreed=True)
                for liar, _ in dissent:  # outvoted: the span's server and this referee agree against it
                    witnesses = [span.peer_id, referee.peer_id]
                    rechecked = await self._recheck(span, witnesses, claimed, liar, ask)
                    outvote(self.manager, liar.peer_id, witnesses, f"{what} as a referee", rechecked=rechecked)
                    if rechecked.verdict == "refuted":  # a tie: the server's outputs are one side's word (0208)
                        raise OutputsDisputed(
                            span.peer_id,
                            f"{what} for blocks {span.start}:{span.end} agree with ...{referee.peer_id[-6:]}, not with "
                            f"...{liar.peer_id[-6:]}, and no server outside them confirms it",
                        )
                return
            logger.info(
                "verification.disagreement(blocks=%d:%d, what=%s, server=...%s, referee=...%s, rel_error=%.3g)",
                span.start, span.end, what, span.peer_id[-6:], referee.peer_id[-6:], error,
            )  # fmt: skip
            for earlier, earlier_out in dissent:
                if self._agree(other, earlier_out, (referee, earlier))[0]:  # two referees outvote the server
                    self.num_verified += 1
                    self.num_rejected += 1
                    message = (
                        f"{what} for blocks {span.start}:{span.end} disagree with ...{referee.peer_id[-6:]} and "
                        f"...{earlier.peer_id[-6:]} (relative error {error:.3g})"
                    )
                    witnesses = [earlier.peer_id, referee.peer_id]
                    rechecked = await self._recheck(span, witnesses, other, span, ask)
                    if outvote(self.manager, span.peer_id, witnesses, message, rechecked=rechecked):
                        raise BadServerOutput(span.peer_id, message, taints_history=True)
                    why = {
                        "refuted": "but no server outside them confirms them",
                        "split": "but the servers outside split",
                    }
                    short = "who are short of a witness's standing"
                    raise OutputsDisputed(span.peer_id, f"{message}, {why.get(rechecked.verdict, short)}")
            dissent.append((referee, other))
        if not dissent:
            return  # every referee failed: nothing was compared
        self.num_verified += 1
        self.num_rejected += 1
        self.manager.bans.record_verified(span.peer_id, agreed=False)
        for referee, _ in dissent:  # no majority: we cannot tell who lies, so trust neither for a while
            self.manager.bans.record_verified(referee.peer_id, agreed=False)
            self._ban(referee, f"disagrees with ...{span.peer_id[-6:]} and no third server decides")
        raise BadServerOutput(
            span.peer_id,
            f"{what} for blocks {span.start}:{span.end} disagree with "
            f"{', '.join('...' + r.peer_id[-6:] for r, _ in dissent)} and no majority decides",
            taints_history=True,
        )

    async def _recheck(
        self,
        span: RemoteSpanInfo,
        witnesses: list[str],
        agreed: tuple[torch.Tensor, ...],
        accused: RemoteSpanInfo,
        ask: Callable[[Chain], Awaitable[tuple[torch.Tensor, ...]]],
    ) -> Rechecked:
        """Where `witnesses` (agreeing on `agreed`) would ban `accused` on standing, servers of `span`'s blocks outside
        the three (whole, or chains of them together: decision 0234) answer the same request first (`ask`), each to
        confirm `agreed` (decision 0208)."""
        if not needs_recheck(self.manager, accused.peer_id, witnesses):
            return UNCHECKED

        async def confirms(outsider: Chain) -> bool | None:
            try:
                theirs = await ask(outsider)
            except Exception as e:  # a referee that failed is not a liar: not counted
                logger.info("verification.recheck_failed(chain=%s, error=%r)", outsider.describe(), e)
                return None
            return self._agree(theirs, agreed, (*outsider.hops, span))[0]

        outsiders = StretchReferees(self.manager, rng=self.rng).outsiders(span, {accused.peer_id, *witnesses})
        return await recheck(outsiders, confirms)

    def _ban(self, span: RemoteSpanInfo, reason: str) -> None:
        logger.warning(
            "verification.ban(peer=...%s, blocks=%d:%d): %s", span.peer_id[-6:], span.start, span.end, reason
        )
        self.manager.on_request_failure(span.peer_id)

"""Cheap verification of a session's spans by recomputation (`StretchVerifier`): the client keeps, per span session,
the outputs each server returned; when a span has `verify_stretch_steps` unverified steps (and at the session's
end) the stretch is sampled with probability `verify_stretch_fraction`, and a replica of the span recomputes it as
ONE stateless `rpc_forward` over the span's inputs for positions [0, b) (one prefill; an existing RPC, so stock
Petals servers serve as replicas and are checked too). The outputs the server claimed for the stretch's positions
[a, b) are compared position by position with the recomputation, within the dtype's tolerance. A disagreement is
decided by a second replica: the server outvoted 2:1 is banned for good (`BanList.ban_liar`); with no second replica
nobody is banned (an honest server must never be banned because one referee lied), and the finding is kept.

Why this catches a rare liar. A server corrupting a fraction q of its steps, with stretches of S steps each
verified with probability f, escapes N of its steps with probability (1 - f (1 - (1 - q)^S))^(N / S). For q = 1%,
N = 1,000, S = 64: f >= 0.54 gives >= 99% by that formula; measured (`python -m benchmarks.field.catch_rate`, 5,000
seeded careers, the session in flight at the 1,000th step never verified) f = 0.55 caught 99.0% (95% interval down to
98.7%), so `DEFAULT_FRACTION` is 0.6: 99.42% caught, 95% interval >= 99.17%. The liar cannot tell which stretches
are checked: the draw happens after the stretch, on the client. Cost: one forward over b tokens per verified stretch
on one replica (a second only on a disagreement), against the S decode steps the stretch took; b grows with the
position (the replica holds no cache), so the recomputed tokens grow with the square of a session's length. Where a
server decodes few sessions, a decode step is bandwidth-bound and such a forward costs about one step; where it
merges many, each decoded token is cheap and the recomputation costs as much as the decoding (NVIDIA H200, 64
sessions: `benchmarks.field.verify_cost`, docs/decisions/0013-stretch-verification.md).
The verification runs in the background (a task on the client loop): it never delays a token."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
from dataclasses import dataclass, field

import torch

from corolla.client import background_loop
from corolla.client.calls.output_checks import verify_rtol
from corolla.client.calls.remote_forward_backward import run_remote_forward
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.protocol.records import RemoteSpanInfo
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

DEFAULT_FRACTION = 0.6  # see the module docstring: q = 1%, N = 1,000, S = 64 -> 99.4% caught (measured)
DEFAULT_STRETCH_STEPS = 64
FINISH_TIMEOUT_S = 30.0  # the longest a session's close waits for its last verifications (a stuck replica's are lost)
# Per-position tolerance (relative L2 error of one position's hidden state) between the server's incremental
# outputs and a replica's one-pass prefill. float32: measured ~1e-6 on CPU; 1e-3 leaves room for other kernels.
# float16 / bfloat16 / quantized weights (nf4, int8): `output_checks.verify_rtol` (32 eps: 0.031 / 0.25) and
# QUANTIZED_STRETCH_RTOL. Measured on an H200 (`benchmarks.field.verify_tolerance`, 10,240 positions, 8 layers, the
# server's Triton decode against a replica's torch prefill): max error 0.0048 in bf16, 0.0054 with NF4 weights on
# both sides: 50x under each (benchmarks/RESULTS.md). A float replica checking a quantized server is not measured.
FP32_STRETCH_RTOL = 1e-3
QUANTIZED_STRETCH_RTOL = 0.3


def escape_probability(lie_rate: float, steps: int, stretch_steps: int, fraction: float) -> float:
    """The chance that a server corrupting `lie_rate` of its steps is not caught within `steps` of them, when each
    stretch of `stretch_steps` steps is verified with probability `fraction` (see the module docstring)."""
    caught_per_stretch = fraction * (1.0 - (1.0 - lie_rate) ** stretch_steps)
    return float((1.0 - caught_per_stretch) ** (steps / stretch_steps))


def stretch_rtol(dtype: torch.dtype, quantized: bool) -> float:
    """The per-position tolerance for outputs in `dtype` (`quantized`: either server announces quantized weights)."""
    rtol = FP32_STRETCH_RTOL if dtype == torch.float32 else verify_rtol(dtype)
    return max(rtol, QUANTIZED_STRETCH_RTOL) if quantized else rtol


def position_errors(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Relative L2 error per position of `a`, `b` [B, T, H] -> [B, T] (float32; 0 where both are zero)."""
    a32, b32 = a.float(), b.float()
    scale = torch.maximum(a32.norm(dim=-1), b32.norm(dim=-1)).clamp_min(1e-12)
    return (a32 - b32).norm(dim=-1) / scale


@dataclass
class SpanRecord:
    """What one span session's server claimed: its outputs [B, n, H] per position, `verified_to` positions checked."""

    span: RemoteSpanInfo
    outputs: torch.Tensor | None = None  # [B, capacity, H]; positions [0, length) valid
    length: int = 0
    verified_to: int = 0
    steps_since: int = 0  # steps since the last stretch ended

    def record(self, outputs: torch.Tensor, first: int) -> None:
        end = first + outputs.shape[1]
        buf = self.outputs
        if buf is None or buf.shape[1] < end or buf.shape[0] != outputs.shape[0]:
            grown = outputs.new_empty(outputs.shape[0], max(2 * end, 16), outputs.shape[2])
            if buf is not None and first > 0:
                grown[:, : min(first, buf.shape[1])] = buf[:, : min(first, buf.shape[1])]
            self.outputs = buf = grown
        buf[:, first:end] = outputs
        self.length = end
        self.verified_to = min(self.verified_to, first)  # a rollback rewrote positions from `first` on
        self.steps_since += 1


@dataclass(frozen=True)
class Finding:
    """A server's claimed outputs shown wrong: blocks, the accused, the span's inputs for [0, b) and its claimed
    outputs for [first, b). Shareable (`corolla.client.verification.findings`); a receiver re-verifies, never bans on it."""

    peer_id: str
    blocks: tuple[int, int]
    inputs: torch.Tensor  # [B, b, H]
    claimed: torch.Tensor  # [B, b - first, H]
    first: int
    max_error: float = field(default=0.0, compare=False)


class StretchVerifier:
    """Per inference session. `after_step(span_session_key, span, outputs, first)` records a span step's outputs and,
    when a stretch is complete, may start its verification in the background; `finish()` verifies what is left
    (sampled the same way) and waits for every verification; `findings` lists what was caught."""

    def __init__(self, manager: RemoteSequenceManager, *, rng: random.Random | None = None):
        self.manager = manager
        self.rng = rng or random.Random()
        self.records: dict[int, SpanRecord] = {}
        self.histories: dict[int, object] = {}  # key -> the span session (its `history` holds the inputs)
        self.tasks: set[concurrent.futures.Future[bool | None]] = set()
        self.num_stretches = 0  # stretches completed
        self.num_verified = 0  # stretches recomputed and compared
        self.num_positions_verified = 0
        self.findings: list[Finding] = []
        self.undecided: list[Finding] = []  # disagreements no second replica could settle (nobody banned)

    @property
    def fraction(self) -> float:
        return self.manager.config.verify_stretch_fraction

    def after_step(
        self, key: int, span_session: object, span: RemoteSpanInfo, outputs: torch.Tensor, first: int
    ) -> None:
        """After the span's server answered positions [first, first + T) with `outputs`."""
        if self.fraction <= 0:
            return
        record = self.records.get(key)
        if record is None or record.span.peer_id != span.peer_id:
            record = self.records[key] = SpanRecord(span)
        self.histories[key] = span_session
        record.record(outputs.detach(), first)
        if record.steps_since >= self.manager.config.verify_stretch_steps:
            self._end_stretch(key)

    def _end_stretch(self, key: int) -> None:
        record, span_session = self.records[key], self.histories[key]
        record.steps_since = 0
        first, end = record.verified_to, record.length
        if end <= first:
            return
        self.num_stretches += 1
        record.verified_to = end
        suspect = self.manager.bans.is_suspect(record.span.peer_id)
        if not (suspect or self.fraction >= 1 or self.rng.random() < self.fraction):
            return
        history = getattr(span_session, "history", None)
        if history is None or history.shape[1] < end or record.outputs is None:
            return
        inputs = history[:, :end].clone()  # [B, end, H]: copies, the session goes on writing its buffers
        claimed = record.outputs[:, first:end].clone()
        # on the client loop, whichever thread stepped (the caller's, for socket streams): never delays a token
        task = asyncio.run_coroutine_threadsafe(
            self.verify(record.span, inputs, claimed, first), background_loop.get_loop()
        )
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def finish(self) -> None:
        """Ends every open stretch (sampled as usual) and waits for the verifications in flight."""
        for key in list(self.records):
            self._end_stretch(key)
        if self.tasks:
            await asyncio.gather(*(asyncio.wrap_future(task) for task in list(self.tasks)), return_exceptions=True)

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

    async def recompute(self, replica: RemoteSpanInfo, inputs: torch.Tensor, first: int) -> torch.Tensor | None:
        """The replica's outputs for positions [first, b) of `inputs` [B, b, H] in one rpc_forward; None if it
        failed (a failed referee is not a liar)."""
        try:
            return (await run_remote_forward(self.manager, replica, inputs, torch.empty(0)))[:, first:]
        except Exception as e:
            logger.info("stretches.replica_failed(peer=...%s, error=%r)", replica.peer_id[-6:], e)
            return None

    def compare(self, a: torch.Tensor, b: torch.Tensor, spans: tuple[RemoteSpanInfo, ...]) -> tuple[bool, float]:
        """(every position of `a` and `b` [B, T, H] agrees within the tolerance, the largest per-position error)."""
        quantized = any(s.server_info.quant_type not in (None, "", "none") for s in spans)
        config_rtol = self.manager.config.verify_rtol
        rtol = config_rtol if config_rtol is not None else stretch_rtol(max(a.dtype, b.dtype, key=_eps), quantized)
        error = float(position_errors(a, b).max()) if a.numel() else 0.0
        return error <= rtol, error

    async def verify(
        self, span: RemoteSpanInfo, inputs: torch.Tensor, claimed: torch.Tensor, first: int
    ) -> bool | None:
        """True: the replica agrees; False: the server was outvoted and banned; None: nothing decided."""
        referees = self.replicas(span, {span.peer_id})
        for index, referee in enumerate(referees):
            recomputed = await self.recompute(referee, inputs, first)
            if recomputed is None:
                continue
            agrees, error = self.compare(claimed, recomputed, (span, referee))
            self.num_verified += 1
            self.num_positions_verified += claimed.shape[1]
            if agrees:
                return True
            finding = Finding(span.peer_id, (span.start, span.end), inputs, claimed, first, error)
            logger.warning(
                "stretches.disagreement(blocks=%d:%d, server=...%s, referee=...%s, positions=%d:%d, max_error=%.3g)",
                span.start, span.end, span.peer_id[-6:], referee.peer_id[-6:], first, inputs.shape[1], error,
            )  # fmt: skip
            for third in referees[index + 1 :]:
                decided = await self.recompute(third, inputs, first)
                if decided is None:
                    continue
                if self.compare(decided, recomputed, (third, referee))[0]:  # two replicas outvote the server
                    self._ban_liar(
                        span.peer_id, span, f"outvoted by ...{referee.peer_id[-6:]}, ...{third.peer_id[-6:]}"
                    )
                    self.findings.append(finding)
                    return False
                if self.compare(decided, claimed, (third, span))[0]:  # the first referee lied
                    self._ban_liar(
                        referee.peer_id, span, f"outvoted by ...{span.peer_id[-6:]}, ...{third.peer_id[-6:]}"
                    )
                    return None
            self.undecided.append(finding)
            logger.warning(
                "stretches.undecided(blocks=%d:%d, server=...%s, referee=...%s): no third replica; nobody banned",
                span.start, span.end, span.peer_id[-6:], referee.peer_id[-6:],
            )  # fmt: skip
            return None
        return None

    def _ban_liar(self, peer_id: str, span: RemoteSpanInfo, reason: str) -> None:
        logger.warning(
            "stretches.liar_banned(peer=...%s, blocks=%d:%d): %s", peer_id[-6:], span.start, span.end, reason
        )
        self.manager.bans.ban_liar(peer_id)
        self.manager.on_request_failure(peer_id)


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps if dtype.is_floating_point else 1.0

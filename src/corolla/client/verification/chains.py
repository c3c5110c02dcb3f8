"""Servers outside a dispute that recheck it together (decision 0234): a `Chain` of hops jointly holding the disputed
span's blocks, run by the client as a route (each hop one stateless `rpc_forward` of the whole stretch, the next hop
fed its outputs), answers as one outside server holding the blocks whole would; servers choose their spans by load,
so often no honest one holds the accused's blocks whole.

A chain is outside the dispute only where every hop is (`chains_over` builds no other); a span with a sub-span held by
the parties alone has no chain and counts in `Outsiders.unheard`, a word not heard (0232's rule: no ban on one
standing). A chain is the attacker's where any hop is, so the seats (`witnesses.OUTSIDERS_MAX`) are given per server,
not per chain (0239): identities on short sub-spans multiply chains, not seats; chains whose every hop has a witness's
standing are seated first (`StretchReferees.outsiders`). A chain's answer is compared in the coarsest dtype any hop
sent (`coarsest`). A chain of k hops is k forwards: a recheck asks its chains only as far as their distinct hop
forwards fit a `HopBudget` (`HOPS_PER_SEAT` per seat), fewest hops first, then by the record of each chain's weakest
server (0250, 0254)."""

from __future__ import annotations

import asyncio
import bisect
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from corolla.client.calls.remote_forward_backward import (
    NO_PROMPTS,
    run_remote_backward,
    run_remote_forward,
    span_prompts,
)
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.protocol.records import RemoteSpanInfo

NO_HOP = -1  # where the hop before a chain's first started: before every block

# hop forwards a recheck may ask per chain it seats (`HopBudget`): every chain of at most this many hops in the
# per-server seats is asked whatever the others are (single-block identities make a chain one forward per block, 0250)
HOPS_PER_SEAT = 4

T = TypeVar("T")
Path = tuple[tuple[str, int, int], ...]  # a chain's hops up to one, (peer id, start, end) each


class HopAnswers:
    """The outputs of the hops of one recheck's chains, by the hops up to each (decision 0237): the chains of one
    recheck run one request, so those that start alike (X1 > X2a, X1 > X2b) send their first hops the same inputs;
    each such hop is asked once, its answer shared (the same request twice at once from one client is refused by a
    server's per-peer caps where its prefix is long, which left a chain unheard and a liar unbanned). `close` when the
    recheck is over: a shared hop runs on while any chain waits for it (one chain's deadline does not cancel it for
    the others), not after."""

    def __init__(self) -> None:
        self.asked: dict[Path, asyncio.Future[torch.Tensor]] = {}

    async def forward(
        self,
        manager: RemoteSequenceManager,
        path: Path,
        hop: RemoteSpanInfo,
        inputs: torch.Tensor,
        prompts: torch.Tensor,
    ) -> torch.Tensor:
        """`run_remote_forward` of `hop` (the last of `path`), once per `path` for every chain of the recheck."""
        answer = self.asked.get(path)
        if answer is None:
            answer = self.asked[path] = asyncio.ensure_future(run_remote_forward(manager, hop, inputs, prompts))
            answer.add_done_callback(lambda done: done.cancelled() or done.exception())  # (read by the chains)
        return await asyncio.shield(answer)

    def close(self) -> None:
        for answer in self.asked.values():
            answer.cancel()


@dataclass(frozen=True)
class Chain:
    """Servers that hold a span's blocks together, in block order: `hops` [start, end) each (one hop where a server
    holds them all: an outside server of decisions 0208 and 0220); `answers`, where it is one of a recheck's chains,
    the hops' answers they share (`HopAnswers`)."""

    hops: tuple[RemoteSpanInfo, ...]
    answers: HopAnswers | None = field(default=None, compare=False, repr=False)

    @property
    def peer_ids(self) -> tuple[str, ...]:
        return tuple(hop.peer_id for hop in self.hops)

    def describe(self) -> str:
        return " > ".join(f"...{hop.peer_id[-6:]}[{hop.start}:{hop.end}]" for hop in self.hops)


@dataclass(frozen=True)
class Outsiders:
    """Who may recheck a dispute over a span: `chains` (whole holders as one-hop chains), and `unheard` (1 where
    servers outside hold some of its blocks but a sub-span is held by the parties alone: no chain, a word not heard);
    `answers`: the hops' answers its chains share, where they do (`HopAnswers`, closed by `witnesses.recheck`)."""

    chains: list[Chain]
    unheard: int = 0
    answers: HopAnswers | None = field(default=None, compare=False, repr=False)


def chains_over(span: RemoteSpanInfo, holders: Sequence[RemoteSpanInfo], rng: random.Random, seats: int) -> Outsiders:
    """Up to `seats` chains over `span`'s blocks of `holders` (outside servers, any overlap), every one where there
    are no more: a server holding the blocks whole is one hop (never a hop of a longer chain: it is asked alone), each
    hop of a longer chain a holder's blocks from where the chain stands to its end or the span's.

    Only chains that no chain of fewer of the same servers can replace: a hop never goes to a holder that also holds
    where the chain's hop before it started (it could have been taken from there, leaving out the hops between), so
    a server is a candidate at one block of any chain only (a chain of the same servers less some is honest wherever
    the longer one is, so nothing honest is lost).

    Seats are given per server, not per chain (decision 0239): at the span's first block every server that starts a
    chain (a whole holder too) gets an equal share of the seats (the remainder drawn by `rng`), and each share is
    split the same way among the servers that go on from that hop's end (one whose chains are fewer than its share
    gives the rest to the others): servers announcing short sub-spans multiply chains, not seats."""
    holders = [h for h in holders if h.start < span.end and span.start < h.end]
    blocks = range(span.start, span.end)
    at = {block: sorted((h for h in holders if h.start <= block < h.end), key=lambda h: h.start) for block in blocks}
    starts = {block: [h.start for h in at[block]] for block in blocks}
    # ways[block][i]: the chains (capped at `seats`: no share is larger) that take at[block][i] at `block`;
    # after[block][i]: those through at[block][i:], the holders that start after a hop that began before them
    ways: dict[int, list[int]] = {}
    after: dict[int, list[int]] = {}

    def onward(block: int, since: int) -> int:
        """The chains (capped) from `block` on, where the hop before it started at `since`."""
        if block == span.end:
            return 1
        return after[block][bisect.bisect_right(starts[block], since)]

    for block in reversed(blocks):
        ways[block] = [onward(min(h.end, span.end), block) for h in at[block]]
        after[block] = [0] * (len(at[block]) + 1)
        for i in reversed(range(len(at[block]))):
            after[block][i] = min(seats, ways[block][i] + after[block][i + 1])
    if not onward(span.start, NO_HOP):
        return Outsiders([], unheard=int(bool(holders)))

    def place(block: int, since: int, share: int, hops: tuple[RemoteSpanInfo, ...]) -> list[Chain]:
        if block == span.end:
            return [Chain(hops)]
        first = bisect.bisect_right(starts[block], since)
        room = {h.peer_id: n for h, n in zip(at[block][first:], ways[block][first:], strict=True) if n}
        options = [h for h in at[block][first:] if h.peer_id in room]
        rng.shuffle(options)  # (who gets the remainder of an uneven share)
        placed = []
        for h, n in zip(options, spread(share, [room[h.peer_id] for h in options]), strict=True):
            if n:
                end = min(h.end, span.end)
                placed += place(end, block, n, (*hops, RemoteSpanInfo(h.peer_id, block, end, h.server_info)))
        return placed

    return Outsiders(place(span.start, NO_HOP, seats, ()))


def hop_paths(chain: Chain) -> set[Path]:
    """The hops up to each of `chain`'s hops: one forward each, shared by the chains of a recheck that start alike
    (`HopAnswers`)."""
    return {tuple((h.peer_id, h.start, h.end) for h in chain.hops[: index + 1]) for index in range(len(chain.hops))}


class HopBudget:
    """The distinct hop forwards (`hop_paths`, a shared one counted once) a recheck may ask, `limit` in all, spent
    by `take` in passes (decisions 0250, 0254)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.spent: set[Path] = set()

    def take(
        self,
        chains: Sequence[Chain],
        *,
        up_to: int | None = None,
        first: Callable[[Chain], tuple[int, ...]] = lambda chain: (),
    ) -> list[Chain]:
        """Those of `chains` (in their order) whose hop forwards fit, the spent ones with them, within `up_to` (at
        most `limit`; default `limit`), taken by `first` (lowest first), fewest hops first among equals: spent
        fewest hops first, every chain of at most n hops fits a budget of n per chain whatever the others are
        (those before it cost no more each); an attacker's identities on single blocks make chains of one hop per
        block, and these get only what is left (decision 0250)."""
        ceiling = self.limit if up_to is None else min(up_to, self.limit)
        kept: set[int] = set()
        for index in sorted(range(len(chains)), key=lambda index: (first(chains[index]), len(chains[index].hops))):
            paths = hop_paths(chains[index])
            if len(self.spent | paths) <= ceiling:
                self.spent |= paths
                kept.add(index)
        return [chain for index, chain in enumerate(chains) if index in kept]


def spread(seats: int, room: Sequence[int]) -> list[int]:
    """`seats` split as evenly as `room` (each one's most) allows, the remainder to the first: min(seats, sum(room))
    given in all."""
    share = [0] * len(room)
    left, open_ = seats, list(range(len(room)))
    while left and open_:
        each, extra = divmod(left, len(open_))
        for rank, i in enumerate(open_):
            given = min(room[i] - share[i], each + (rank < extra))
            share[i] += given
            left -= given
        open_ = [i for i in open_ if share[i] < room[i]]
    return share


async def within_one_request(manager: RemoteSequenceManager, chain: Chain, calls: Awaitable[T]) -> T:
    """`calls` (a chain's hops, one after another), within one `request_timeout_s` where there are several: each hop
    has that long already, so an attacker's identities on k hops of one chain, each holding its answer nearly that
    long, would hold the recheck k times as long as one outside server can (TimeoutError, a failed chain)."""
    if len(chain.hops) == 1:
        return await calls
    return await asyncio.wait_for(calls, manager.config.request_timeout_s)


async def hop_forward(
    manager: RemoteSequenceManager,
    span: RemoteSpanInfo,
    chain: Chain,
    index: int,
    inputs: torch.Tensor,
    prompts: torch.Tensor,
) -> torch.Tensor:
    """The outputs of `chain`'s hop `index` for `inputs` (its hops before it having run), with its share of `span`'s
    deep `prompts`: asked once for the recheck's chains that start alike (`chain.answers`)."""
    hop = chain.hops[index]
    if chain.answers is None:
        return await run_remote_forward(manager, hop, inputs, span_prompts(prompts, span.start, hop))
    path = tuple((h.peer_id, h.start, h.end) for h in chain.hops[: index + 1])
    return await chain.answers.forward(manager, path, hop, inputs, span_prompts(prompts, span.start, hop))


async def chain_forward(
    manager: RemoteSequenceManager, span: RemoteSpanInfo, chain: Chain, inputs: torch.Tensor, prompts: torch.Tensor
) -> torch.Tensor:
    """Outputs [B, T, H] of `span`'s blocks for `inputs` [B, T, H] (and `span`'s deep prompts), computed hop by hop
    along `chain` (each hop's outputs at every position are the next hop's inputs), within one `request_timeout_s`."""

    async def run() -> torch.Tensor:
        hidden, sent = inputs, []
        for index in range(len(chain.hops)):
            hidden = await hop_forward(manager, span, chain, index, hidden, prompts)
            sent.append(hidden.dtype)
        return hidden.to(coarsest(sent))

    return await within_one_request(manager, chain, run())


def coarsest(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """The dtype of the largest rounding among `dtypes` (the wire dtypes a chain's hops sent their outputs in), in
    which the chain's answer is compared: a server sends its outputs in the dtype it computes in, and a hop's
    rounding goes on through the hops after it (a bfloat16 hop's 0.2% before a float32 one), so an answer compared in
    its last hop's float32 alone (1e-3) refuted honest witnesses; one server computing in bfloat16 is compared at
    bfloat16's tolerance, and so is a chain with a hop that does (`output_checks.verify_rtol`, decision 0239)."""
    return max(dtypes, key=lambda dtype: torch.finfo(dtype).eps)


async def chain_backward(
    manager: RemoteSequenceManager,
    span: RemoteSpanInfo,
    chain: Chain,
    inputs: torch.Tensor,
    grad_outputs: torch.Tensor,
    prompts: torch.Tensor = NO_PROMPTS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(grad wrt `inputs` [B, T, H], grad wrt `span`'s deep prompts or None) for `grad_outputs` [B, T, H], along
    `chain`: a forward through every hop but the last gives each hop its inputs, then each hop's backward, last first
    (all within one `request_timeout_s`)."""

    async def run() -> tuple[torch.Tensor, torch.Tensor | None]:
        hop_inputs = [inputs]
        for index in range(len(chain.hops) - 1):
            hop_inputs.append(await hop_forward(manager, span, chain, index, hop_inputs[-1], prompts))
        grad = grad_outputs
        grad_prompts: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # (a hop's prompts, their gradient)
        sent = [hidden.dtype for hidden in hop_inputs[1:]]  # (the answer in the coarsest any hop sent: `coarsest`)
        for hop, hidden in reversed(list(zip(chain.hops, hop_inputs, strict=True))):
            own_prompts = span_prompts(prompts, span.start, hop)
            grad, hop_grad = await run_remote_backward(manager, hop, hidden, grad, own_prompts)
            grad_prompts.insert(0, (own_prompts, hop_grad))
            sent += [grad.dtype] if hop_grad is None else [grad.dtype, hop_grad.dtype]
        if all(hop_grad is None for _, hop_grad in grad_prompts):  # (as one server answers: no prompts' gradient)
            return grad.to(coarsest(sent)), None
        # a hop that sent none for its prompts: zeros there (its blocks' prompts did not move the outputs)
        grads = torch.cat([torch.zeros_like(own) if g is None else g.to(own.dtype) for own, g in grad_prompts])
        return grad.to(coarsest(sent)), grads.to(coarsest(sent))

    return await within_one_request(manager, chain, run())

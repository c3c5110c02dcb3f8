"""A dispute rechecked by a chain of servers outside it that hold the accused's blocks together (decision 0234): where
no honest server holds them whole (H serves 0:4, the honest others 0:2 and 2:4), two identities with standing no
longer frame H for good; a chain through one of the parties is never asked; a liar is still banned where only chains
recheck (in-process fakes, no network)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
import torch
from hivemind.proto import runtime_pb2
from tests.unit.test_client_avoided_outsiders import OneShot
from tests.unit.test_client_distrust import FramersFirst, Server
from tests.unit.test_client_remote_sequential import FakeForwardServer, run_blocks

from corolla.client.calls.remote_forward_backward import NO_PROMPTS
from corolla.client.verification.chains import (
    HOPS_PER_SEAT,
    Chain,
    HopBudget,
    Outsiders,
    chain_backward,
    chain_forward,
    chains_over,
    hop_paths,
)
from corolla.client.verification.stretches import StretchReferees, record_floors
from corolla.client.verification.witnesses import OUTSIDERS_MAX, RECORD_SEATS, trusted
from corolla.protocol.codecs import deserialize_tensor, serialize_tensor
from corolla.protocol.records import RemoteSpanInfo
from helpers.fake_chain import HIDDEN, FakeManager, record_of, reference, vouch
from helpers.framed_session import framed_client, run_framed


def _framers(span: int = 4) -> dict[str, Server]:
    """H (honest, the best figures: routed first) on blocks 0:`span`; SA and SB, one attacker's identities on the same
    blocks, referee H's first step with the same made-up outputs (then answer honestly)."""
    return {"H": Server(0, span, inference_rps=1e6), "SA": OneShot(0, span, lies=1), "SB": OneShot(0, span, lies=1)}


def _outvoted_liar() -> dict[str, Server]:
    """L lies at once (finite garbage, the best figures: routed first) on blocks 0:4; H1 and H2, honest, outvote it."""
    liar = Server(0, 4, "garbage", inference_rps=1e6)
    return {"L": liar, "H1": Server(0, 4, inference_rps=1e4), "H2": Server(0, 4, inference_rps=1e4)}


@pytest.mark.parametrize("third_identity", [False, True], ids=["honest_chains", "a_third_identity_on_a_hop"])
def test_two_identities_with_standing_cannot_frame_a_server_nobody_else_holds_whole(third_identity):
    """Decision 0232's gap (c). H (honest, routed first) serves 0:4; SA and SB, one attacker's identities that both have
    a witness's standing, referee H's first step with the same made-up outputs (then answer honestly); the honest
    others serve 0:2 (X1, X1b) and 2:4 (X2, X2b), nobody outside the three holds 0:4 whole. Main: nobody to recheck,
    "unchecked" on two standings: H banned for good (hrev16: 3 of 3 runs, after the framers earned standing in 16-29
    of H's verified steps). Now chains of the honest others (X1 > X2, ...) run the step as a route and refute the
    framers: nobody banned, H avoided, the framers lose their standing; with the attacker's third identity S3 on a hop
    of one chain (confirming them), the chains split: nobody banned, H avoided and the framers watched."""
    torch.manual_seed(6)
    servers = {**_framers(), "X1": Server(0, 2), "X1b": Server(0, 2), "X2": Server(2, 4), "X2b": Server(2, 4)}
    if third_identity:
        servers["S3"] = OneShot(2, 4, lies=1)  # (6 chains, each asked: 2 through S3)
    manager = framed_client(servers, "SA", "SB")
    run_framed(manager, torch.randn(1, 6, HIDDEN), FramersFirst())
    assert not manager.bans.is_liar("H") and not manager.bans.is_banned("H"), manager.bans.banned_peers()
    assert "H" in manager.avoided_peers()
    assert servers["X1"].forward_calls and servers["X2"].forward_calls  # asked as a chain
    if third_identity:
        assert servers["S3"].forward_calls and {"SA", "SB"} <= manager.disputes.watched()
    else:
        assert not trusted(manager, "SA") and not trusted(manager, "SB")
        assert {"SA", "SB"} <= manager.avoided_peers()


@pytest.mark.parametrize("held_by", ["the_framers", "the_accused"])
def test_a_chain_through_a_party_is_never_asked(held_by):
    """Blocks 2:4 are held by the parties of the dispute only; X1 (honest) holds 0:2. A chain X1 > (a party) would
    answer for that party's side, so none is built, and X1 is asked nothing:
    - `the_framers`: SA (standing) and SB (fresh) frame H. Through SA, the chain would confirm them; built from
      outside servers, there is none, and a server outside holding part of the blocks is a word not heard (decision
      0232's rule): no ban on one standing, H avoided, SA and SB watched. Main: H banned for good on SA's standing.
    - `the_accused`: L lies, outvoted by H1 and H2 (both with standing). Through L, the chain would refute them and
      clear L; there is none, and two standings ban (decision 0226): L banned for good (as on main)."""
    torch.manual_seed(6)
    if held_by == "the_framers":
        servers = {**_framers(), "X1": Server(0, 2)}
        manager = framed_client(servers, "SA")
    else:
        servers = {**_outvoted_liar(), "X1": Server(0, 2)}
        manager = framed_client(servers, "H1", "H2")
    run_framed(manager, torch.randn(1, 6, HIDDEN), FramersFirst())
    assert servers["X1"].forward_calls == 0
    if held_by == "the_framers":
        assert not manager.bans.is_liar("H") and not manager.bans.is_banned("H"), manager.bans.banned_peers()
        assert "H" in manager.avoided_peers() and {"SA", "SB"} <= manager.disputes.watched()
    else:
        assert manager.bans.is_liar("L") and trusted(manager, "H1") and trusted(manager, "H2")


def test_a_liar_is_still_banned_where_only_chains_recheck():
    """L lies at once (finite garbage, routed first); H1 (standing) and H2 (fresh) outvote it; nobody outside holds
    0:4 whole, X1 (0:2) and X2 (2:4) together do: their chain confirms H1 and H2, and L is banned for good on H1's
    standing (spent: the ban rests on it alone, the chain being fresh)."""
    torch.manual_seed(7)
    servers = {**_outvoted_liar(), "X1": Server(0, 2), "X2": Server(2, 4)}
    manager = framed_client(servers, "H1")
    run_framed(manager, torch.randn(1, 4, HIDDEN))
    assert manager.bans.is_liar("L") and servers["X1"].forward_calls == servers["X2"].forward_calls == 1
    assert not manager.bans.banned_peers() & {"H1", "H2", "X1", "X2"}


class InDtype(Server):
    """Computes in `dtype`, as a real server computes in its blocks' dtype: its inputs cast to it, its outputs sent in
    it (`server.front.block_functions`)."""

    def __init__(self, start: int, end: int, dtype: torch.dtype):
        super().__init__(start, end)
        self.dtype = dtype

    async def rpc_forward(self, request, timeout=None):
        tensors = [serialize_tensor(deserialize_tensor(t).to(self.dtype)) for t in request.tensors]
        cast = runtime_pb2.ExpertRequest(uid=request.uid, metadata=request.metadata, tensors=tensors)
        response = await super().rpc_forward(cast, timeout)
        return runtime_pb2.ExpertResponse(tensors=[serialize_tensor(deserialize_tensor(t)) for t in response.tensors])


def test_a_chain_with_a_bfloat16_hop_is_compared_at_bfloat16s_tolerance():
    """Decision 0239 (0237's tolerance finding). L lies, H1 (standing) and H2 (fresh) outvote it; the one chain outside
    is X1 (0:2, computing in bfloat16) > X2 (2:4, float32). Main compared the chain's float32 answer at float32's
    tolerance (1e-3), blind to the rounding X1's bfloat16 outputs carried into X2 (~0.2%): the honest chain refuted
    the honest witnesses, L was not banned and H1 and H2 lost their standing. Now a chain's answer is compared in the
    coarsest dtype any hop sent (as one server computing in bfloat16 is): it confirms them, L banned for good."""
    torch.manual_seed(7)
    servers = {**_outvoted_liar(), "X1": InDtype(0, 2, torch.bfloat16), "X2": InDtype(2, 4, torch.float32)}
    manager = framed_client(servers, "H1")
    run_framed(manager, torch.randn(1, 4, HIDDEN))
    assert servers["X1"].forward_calls == servers["X2"].forward_calls == 1
    assert manager.bans.is_liar("L") and not manager.bans.banned_peers() & {"H1", "H2", "X1", "X2"}


class OneAtATime(Server):
    """Refuses a forward while another of the same client is in flight (as a server's per-peer stream byte cap,
    96 MiB, refuses a client's second 64 MiB prefix at once: 4,096 positions at hidden 8,192 in float16), holding each
    for `HOLD_ITERATIONS` turns of the loop (its compute; ordered by the loop, not by time)."""

    HOLD_ITERATIONS = 20

    def __init__(self, start: int, end: int):
        super().__init__(start, end)
        self.in_flight = self.refused = 0

    async def rpc_forward(self, request, timeout=None):
        if self.in_flight:
            self.refused += 1
            raise ConnectionError("a forward of this peer is in flight: refused")
        self.in_flight += 1
        try:
            for _ in range(self.HOLD_ITERATIONS):
                await asyncio.sleep(0)
            return await super().rpc_forward(request, timeout)
        finally:
            self.in_flight -= 1


def test_chains_that_start_alike_ask_their_first_hop_once():
    """hrev17's finding 3 (decision 0237). L lies, H1 (standing) and H2 (fresh) outvote it; X1 alone holds 0:2, X2a
    and X2b hold 2:4: both chains (X1 > X2a, X1 > X2b) are asked at once, and both send X1 the same request. Main sent
    it twice; X1, refusing a second forward of the client in flight, failed one chain: an outsider not heard, and a
    ban on H1's one standing is none (decision 0232): L only avoided. Now a recheck's chains ask a hop the same
    request once (`chains.HopAnswers`): X1 answers both, they confirm, L banned for good."""
    torch.manual_seed(7)
    servers = {**_outvoted_liar(), "X1": OneAtATime(0, 2), "X2a": Server(2, 4), "X2b": Server(2, 4)}
    manager = framed_client(servers, "H1")
    run_framed(manager, torch.randn(1, 4, HIDDEN))
    assert servers["X1"].forward_calls == 1 and servers["X1"].refused == 0
    assert servers["X2a"].forward_calls == servers["X2b"].forward_calls == 1
    assert manager.bans.is_liar("L") and not manager.bans.banned_peers() & {"H1", "H2", "X1", "X2a", "X2b"}


def _span(peer_id: str, start: int, end: int) -> RemoteSpanInfo:
    return RemoteSpanInfo(peer_id, start, end, record_of(start, end, 100.0))


def test_chains_cover_the_span_from_outside_holders_and_say_when_none_can():
    span = _span("accused", 0, 4)
    holders = [_span("W", 0, 8), _span("A1", 0, 2), _span("A2", 0, 1), _span("B1", 2, 4), _span("C1", 1, 4)]
    outsiders = chains_over(span, holders, random.Random(0), seats=8)
    routes = {tuple((hop.peer_id, hop.start, hop.end) for hop in chain.hops) for chain in outsiders.chains}
    assert outsiders.unheard == 0 and routes == {
        (("W", 0, 4),),  # held whole: asked alone, never a hop
        (("A1", 0, 2), ("B1", 2, 4)),
        (("A1", 0, 2), ("C1", 2, 4)),
        (("A2", 0, 1), ("C1", 1, 4)),
        # not A2 > A1 > B1 (nor > C1): A1 holds block 0, where A2's hop started; A1 > B1 is the same servers less A2
    }
    # more chains than seats: the seats, each chain over [0, 4) hop after hop, one a server at block 0 (9 for 8)
    many = [_span(f"{name}{i}", start, end) for i in range(9) for name, start, end in (("P", 0, 2), ("Q", 2, 4))]
    drawn = chains_over(span, many, random.Random(0), seats=8).chains
    assert len(drawn) == len({chain.hops[0].peer_id for chain in drawn}) == 8
    assert all([(h.start, h.end) for h in chain.hops] == [(0, 2), (2, 4)] for chain in drawn)
    # blocks 2:4 held by nobody outside: no chain, one word not heard; nobody outside at all (a span of three): none
    assert chains_over(span, [_span("A1", 0, 2)], random.Random(0), seats=8) == Outsiders([], unheard=1)
    assert chains_over(span, [], random.Random(0), seats=8) == Outsiders([], unheard=0)


def test_a_chain_runs_the_stretch_as_a_route_with_each_hops_deep_prompts():
    torch.manual_seed(3)
    servers = {"A": Server(0, 1), "B": Server(1, 3), "C": Server(3, 4)}
    manager = FakeManager(servers, 4)
    span = _span("accused", 0, 4)
    outsiders = StretchReferees(manager).outsiders(span, {"accused"})
    assert [chain.peer_ids for chain in outsiders.chains] == [("A", "B", "C")]
    inputs, prompts = torch.randn(1, 5, HIDDEN), torch.randn(4, 1, 2, HIDDEN)
    outputs = asyncio.run(chain_forward(manager, span, outsiders.chains[0], inputs, prompts))
    torch.testing.assert_close(outputs, reference(inputs, 4, prompts), atol=1e-5, rtol=0)
    assert [server.forward_calls for server in servers.values()] == [1, 1, 1]


@pytest.mark.parametrize("with_prompts", [False, True], ids=["no_prompts", "deep_prompts"])
def test_a_chain_runs_a_training_backward_hop_by_hop(with_prompts):
    """A verified backward's recheck by a chain (`chain_backward`): each hop gets its inputs from a forward through the
    hops before it, then the hops' backwards run last first; the gradients wrt the inputs and the span's deep prompts
    are local autograd's."""
    torch.manual_seed(4)
    servers = {"A": FakeForwardServer(0, 1), "B": FakeForwardServer(1, 3), "C": FakeForwardServer(3, 4)}
    manager = FakeManager(servers, 4)
    span = _span("accused", 0, 4)
    (chain,) = StretchReferees(manager).outsiders(span, {"accused"}).chains
    x, grad = torch.randn(2, 5, HIDDEN), torch.randn(2, 5, HIDDEN)
    prompts = torch.randn(4, 1, 2, HIDDEN) if with_prompts else NO_PROMPTS
    grad_x, grad_prompts = asyncio.run(chain_backward(manager, span, chain, x, grad, prompts))
    x_ref = x.clone().requires_grad_(True)
    p_ref = prompts.clone().requires_grad_(True) if with_prompts else None
    run_blocks([0, 1, 2, 3], x_ref, p_ref).backward(grad)
    torch.testing.assert_close(grad_x, x_ref.grad, atol=1e-5, rtol=0)
    if p_ref is None:
        assert grad_prompts is None
    else:
        torch.testing.assert_close(grad_prompts, p_ref.grad, atol=1e-5, rtol=0)
    assert [server.calls for server in servers.values()] == [
        ["forward", "backward"],
        ["forward", "backward"],
        ["backward"],
    ]


class Holding(Server):
    """Answers each `rpc_forward` at `until` seconds after `started[0]` (loop time, set when the chain starts): each
    hop's answer within any one request's timeout, the chain's past it."""

    def __init__(self, start: int, end: int, until: float, started: list[float]):
        super().__init__(start, end)
        self.until, self.started, self.asked = until, started, 0

    async def rpc_forward(self, request, timeout=None):
        self.asked += 1
        # (never 0: a hop entered past the deadline after a pause still answers on a timer due after it, so the
        # deadline's wake-up comes first; the fakes answer in the same loop iteration otherwise)
        await asyncio.sleep(max(0.01, self.started[0] + self.until - asyncio.get_running_loop().time()))
        return await super().rpc_forward(request, timeout)


def test_a_chains_hops_share_one_request_timeout():
    """An attacker's identities on every hop of a chain, each holding its answer nearly `request_timeout_s`, must not
    hold a recheck k times as long as one outside server can: the chain's hops run within one request timeout (the
    fakes have no per-call timeout: without it the chain answers after both holds). A answers 0.6 timeouts after the
    chain starts, B 1.2: each hop's end is set from the chain's start, not by a hold of its own, so a pause of the
    loop (up to a timeout) before either hop moves nothing past the deadline (hrev17: a 0.1 s pause before A's hold
    of 0.15 s of 0.2 failed the test's earlier form)."""
    started: list[float] = []
    timeout_s = 1.5
    servers = {"A": Holding(0, 2, 0.6 * timeout_s, started), "B": Holding(2, 4, 1.2 * timeout_s, started)}
    manager = FakeManager(servers, 4, request_timeout_s=timeout_s)
    span = _span("accused", 0, 4)
    (chain,) = StretchReferees(manager).outsiders(span, {"accused"}).chains

    async def run() -> None:
        started.append(asyncio.get_running_loop().time())  # (no await before chain_forward sets its deadline)
        await chain_forward(manager, span, chain, torch.randn(1, 3, HIDDEN), NO_PROMPTS)

    with pytest.raises(TimeoutError):
        asyncio.run(run())
    assert servers["A"].asked == 1 and servers["B"].forward_calls == 0  # (B's answer: past the chain's deadline)


def test_fresh_identities_on_short_sub_spans_never_push_a_chain_with_standing_out_of_the_seats():
    """hrev17's finding 1 (decision 0237). X1 (0:2) and X2 (2:4), honest, have a witness's standing: their chain X1 >
    X2 is seated first, as a whole holder with standing is (0208). The attacker adds three fresh identities on each
    single block (12, no standing needed): (3^2 + 3 + 1)^2 = 169 chains over 0:4, every one but X1 > X2 through one
    of them (an intermediate hop that fails leaves a chain silent, the last one answers the framers' outputs). Main
    drew 64 of the 169 uniformly and seated only those: X1 > X2 was asked in 6 of these 20 draws (the framers, with
    two standings, banned H in the 14 others); now the chains of servers with standing are built first."""
    servers = {"H": Server(0, 4), "SA": Server(0, 4), "SB": Server(0, 4), "X1": Server(0, 2), "X2": Server(2, 4)}
    servers |= {f"F{block}.{i}": Server(block, block + 1) for block in range(4) for i in range(3)}
    manager = FakeManager(servers, 4)
    vouch(manager, "SA", "SB", "X1", "X2")
    span = _span("H", 0, 4)
    for seed in range(20):
        outsiders = StretchReferees(manager, rng=random.Random(seed)).outsiders(span, {"H", "SA", "SB"})
        assert outsiders.chains[0].peer_ids == ("X1", "X2"), seed


def _seated(manager: FakeManager, seed: int) -> list[tuple[str, ...]]:
    span = _span("H", 0, 4)
    outsiders = StretchReferees(manager, rng=random.Random(seed)).outsiders(span, {"H"})
    return [chain.peer_ids for chain in outsiders.chains[: OUTSIDERS_MAX + RECORD_SEATS]]  # (those a recheck asks)


@pytest.mark.parametrize("honest", ["a_chain", "a_whole_holder"])
def test_cheap_identities_on_single_blocks_take_one_servers_share_of_the_seats(honest):
    """Decision 0239 (hrev17's finding kept open in 0237). Nobody outside H has standing; the honest outside servers
    are X1 (0:2) and X2 (2:4), or W (0:4); the attacker adds three fresh identities on each single block of 0:4 (12).
    Main drew the seats uniformly over chains, and those identities make 169 of them, all but one through them: X1 >
    X2 was seated in 4.5% of draws, W (one chain against 64 drawn) in 17%. Now the seats are given per server: the
    4 servers that start a chain (X1 or W, and the three on block 0) hold 2 of the 8 each, in every draw; X1's two go
    to two of X2 and the three on block 2 (X2 seated in half the draws); W's one is W's."""
    servers = {f"F{block}.{i}": Server(block, block + 1) for block in range(4) for i in range(3)}
    servers |= {"W": Server(0, 4)} if honest == "a_whole_holder" else {"X1": Server(0, 2), "X2": Server(2, 4)}
    manager = FakeManager(servers, 4)
    draws = [_seated(manager, seed) for seed in range(200)]
    for seated in draws:
        assert len(seated) == 8
        starts = Counter(peers[0] for peers in seated)
        assert sorted(starts) == sorted(["F0.0", "F0.1", "F0.2", "W" if honest == "a_whole_holder" else "X1"])
        assert set(starts.values()) == {2} or (honest == "a_whole_holder" and starts["W"] == 1)
    if honest == "a_whole_holder":
        assert all(("W",) in seated for seated in draws)
    else:  # (a draw of 2 of 4: half of 200, give or take sampling)
        assert 75 <= sum(("X1", "X2") in seated for seated in draws) <= 125


class Unanswering(Server):
    """An attacker's cheap identity: every stateless forward fails, so a chain through it is silent (not counted: a
    failed server is no liar), which a ban resting on two standings ignores (decision 0232's rule)."""

    async def rpc_forward(self, request, timeout=None):
        self.forward_calls += 1
        raise ConnectionError("no answer")


class FramersFirstDrawn(FramersFirst):
    """The framers referee first; every other draw (the seats' remainders too) random, by the seed."""

    def shuffle(self, x: list) -> None:  # type: ignore[override]
        random.Random.shuffle(self, x)
        super().shuffle(x)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cheap_identities_on_single_blocks_cannot_crowd_the_honest_chains_out_of_a_framing(seed):
    """Decision 0239, end to end. SA and SB (one attacker, both with standing) frame H (0:4) with the same made-up
    outputs; X1, X1b (0:2) and X2, X2b (2:4), honest, have no standing; the attacker announces 42 fresh identities on
    single blocks (one on block 0, twenty on block 1, one on block 2, twenty on block 3; slow: never routed), each
    failing every recheck forward. They make 576 chains, 4 of them honest: main drew 64 uniformly and seated 8 of
    those, and the rest were silent: "unchecked" on two standings, H banned for good (each of these seeds). Now the
    servers that start a chain at block 0 hold the seats in equal shares (X1 and X1b 3 or 2 each against the one
    identity there), and each share is split among the servers at block 2 (X2, X2b and one identity): honest chains
    refute the framers in every draw, nobody is banned, H avoided, SA and SB lose their standing."""
    torch.manual_seed(6)
    servers = {**_framers(), "X1": Server(0, 2), "X1b": Server(0, 2), "X2": Server(2, 4), "X2b": Server(2, 4)}
    for block, count in ((0, 1), (1, 20), (2, 1), (3, 20)):
        servers |= {f"F{block}.{i}": Unanswering(block, block + 1, inference_rps=1.0) for i in range(count)}
    manager = framed_client(servers, "SA", "SB")
    run_framed(manager, torch.randn(1, 6, HIDDEN), FramersFirstDrawn(seed))
    assert not manager.bans.is_liar("H") and not manager.bans.is_banned("H"), manager.bans.banned_peers()
    assert "H" in manager.avoided_peers() and servers["X1"].forward_calls and servers["X2"].forward_calls
    assert not trusted(manager, "SA") and not trusted(manager, "SB") and {"SA", "SB"} <= manager.avoided_peers()


def _record(manager: FakeManager, steps: int, *peers: str) -> None:
    """`steps` verified steps of each of `peers` that agreed with another server, short of a witness's standing: the
    record a client keeps of servers it routed through and checked (`BanList.agreed_in_a_row`)."""
    for _ in range(steps):
        for peer in peers:
            manager.bans.record_verified(peer, agreed=True)


def _mirror(count: int) -> dict[str, Server]:
    """`count` cheap identities announcing the honest servers' own blocks (half 0:2, half 2:4; slow: never routed),
    each failing every recheck forward."""
    return {f"F{i}": Unanswering(*((0, 2) if i % 2 == 0 else (2, 4)), inference_rps=1.0) for i in range(count)}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cheap_identities_on_the_honest_servers_own_blocks_cannot_frame_a_server(seed):
    """Decision 0246 (0239's Left). SA and SB (one attacker, both with standing) frame H (0:4) with the same made-up
    outputs; X1 (0:2) and X2 (2:4), honest, have no standing but a record of 2 verified agreeing steps with this
    client; the attacker announces 32 fresh identities on X1's and X2's own blocks (16 each), failing every recheck
    forward. Per server (0239) X1 > X2 held 8 / (17 * 17) of the seats: seated in 2.5% of draws, "unchecked" on two
    standings banned H for good in the rest (main: each of these seeds). Now the chains of servers with the longest record
    not seated per server get `RECORD_SEATS` more: X1 > X2 refutes the framers in every draw, nobody banned, SA and
    SB lose their standing."""
    torch.manual_seed(6)
    servers = {**_framers(), "X1": Server(0, 2), "X2": Server(2, 4)}
    servers |= _mirror(32)
    manager = framed_client(servers, "SA", "SB")  # (X1 > X2 of a record: always asked, beside 8 per server)
    _record(manager, 2, "X1", "X2")
    run_framed(manager, torch.randn(1, 6, HIDDEN), FramersFirstDrawn(seed))
    assert not manager.bans.is_liar("H") and not manager.bans.is_banned("H"), manager.bans.banned_peers()
    assert servers["X1"].forward_calls and servers["X2"].forward_calls
    assert not trusted(manager, "SA") and not trusted(manager, "SB") and {"SA", "SB"} <= manager.avoided_peers()


@pytest.mark.parametrize("cheap_record", [0, 1, 3])
def test_record_seats_go_to_the_servers_this_client_saw_do_more_verified_work(cheap_record):
    """Decision 0246's record seats (`record_floors`: standing 8, then 4, 2, 1). X1 (0:2) and X2 (2:4) have a record
    of 5 verified steps (floor 4); 32 identities on their own blocks have `cheap_record` steps each (none; one, bought
    by one verified step each; 3, short of the honest servers' floor): X1 > X2 is asked in every draw (main: in 2.5%
    of draws, the per-server share). At the honest servers' floor (4 steps each: four of the client's steps each
    computed right, as X1's were) they share the record seats per server too: X1 > X2 then in about 12 / 289 of the
    draws, not every one."""
    servers = {"X1": Server(0, 2), "X2": Server(2, 4), **_mirror(32)}
    manager = FakeManager(servers, 4)
    _record(manager, 5, "X1", "X2")
    _record(manager, cheap_record, *(peer for peer in servers if peer.startswith("F")))
    assert all(("X1", "X2") in _seated(manager, seed) for seed in range(50))
    _record(manager, 4 - cheap_record, *(peer for peer in servers if peer.startswith("F")))
    assert sum(("X1", "X2") in _seated(manager, seed) for seed in range(50)) < 25


def test_records_of_the_attackers_identities_take_no_seat_from_an_honest_chain_without_one():
    """The record seats are added to the per-server seats (0239), not ordered before them: X1 > X2 (no record) against
    32 identities on their own blocks, each with a record of 4 verified steps, keeps its per-server share of the
    first `OUTSIDERS_MAX` seats, draw for draw as without their records (seats ordered by record would leave it none:
    eight recorded identities, one verified step each, would take every seat from honest servers the client never
    routed through)."""
    servers = {"X1": Server(0, 2), "X2": Server(2, 4), **_mirror(32)}
    plain, recorded = FakeManager(servers, 4), FakeManager(servers, 4)
    _record(recorded, 4, *(peer for peer in servers if peer.startswith("F")))
    for seed in range(50):
        assert _seated(recorded, seed)[:OUTSIDERS_MAX] == _seated(plain, seed), seed
        assert len(_seated(recorded, seed)) == OUTSIDERS_MAX + RECORD_SEATS


def test_record_floors_halve_a_witnesss_standing_down_to_one_step():
    assert record_floors(8) == [8, 4, 2, 1]
    assert record_floors(5) == [5, 2, 1]
    assert record_floors(1) == [1]
    assert record_floors(0) == []  # (any two ban: no record seats)


def test_a_recorded_chain_drawn_past_the_seats_still_gets_a_record_seat():
    """Decision 0247 (hrev19's finding on 0246). The attacker has 7 identities with a witness's standing holding H's
    blocks whole (C0..C6: the first tier, 7 chains) and 7 fresh ones on them too; X1 (0:2) > X2 (2:4), honest, a
    record of 2 steps. The second tier (any server) draws 8 more chains per server, X1 > X2 among them in about half
    the draws, but only the first 8 of both tiers are asked; the record seats skipped every chain either tier had
    drawn, asked or cut, so X1 > X2, cut there, got no record seat either: main asked it in 58% of 2,000 draws (the
    framers' identity with standing confirming alone would ban H in the rest). Now a record seat goes to any recorded
    chain not asked: X1 > X2 in every draw."""
    servers = {"X1": Server(0, 2), "X2": Server(2, 4)}
    servers |= {f"C{i}": Server(0, 4) for i in range(7)} | {f"M{i}": Server(0, 4) for i in range(7)}
    manager = FakeManager(servers, 4)
    vouch(manager, *(f"C{i}" for i in range(7)))
    _record(manager, 2, "X1", "X2")
    assert all(("X1", "X2") in _seated(manager, seed) for seed in range(200))


class OnceFramer(OneShot):
    """One of the attacker's identities outside the dispute (standing earned, slow: never routed): as an outsider it
    answers the framers' made-up outputs once, then serves honestly."""

    def __init__(self, start: int, end: int):
        super().__init__(start, end, lies=1)
        self.inference_rps = 1.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_identities_with_standing_outside_cannot_push_a_recorded_chain_past_its_record_seat(seed):
    """Decision 0247, end to end. SA and SB (both with standing) frame H (0:4); the attacker's C0..C6 (0:4, standing
    too) confirm the framers as outsiders, M0..M6 (0:4, fresh) fail every recheck forward; X1 (0:2) > X2 (2:4), honest,
    a record of 2. Main banned H for good on these seeds (9 of 20 overall): X1 > X2 drawn by the second tier past the
    8th seat got no record seat either. Now it does: refuted, nobody banned."""
    torch.manual_seed(6)
    servers = {**_framers(), "X1": Server(0, 2), "X2": Server(2, 4)}
    servers |= {f"C{i}": OnceFramer(0, 4) for i in range(7)}
    servers |= {f"M{i}": Unanswering(0, 4, inference_rps=1.0) for i in range(7)}
    manager = framed_client(servers, "SA", "SB", *(f"C{i}" for i in range(7)))
    _record(manager, 2, "X1", "X2")
    run_framed(manager, torch.randn(1, 6, HIDDEN), FramersFirstDrawn(seed))
    assert not manager.bans.is_liar("H") and not manager.bans.is_banned("H"), manager.bans.banned_peers()
    assert servers["X1"].forward_calls and servers["X2"].forward_calls


def test_a_rechecks_hop_forwards_are_bounded_against_single_block_identities():
    """Decision 0250 (0247's Left). Three cheap identities on each of 80 blocks, X1 (0:40) > X2 (40:80) honest: each
    chain through the identities is one hop forward per block (the stretch's activations both ways each), and main
    asked 12 of them: up to 558 forwards in these 50 draws (486 on average; 960 at most), every recheck this client
    makes. Now a recheck's hop forwards are `HOPS_PER_SEAT` per seat at most (48), taken fewest hops first: X1 > X2
    (2 hops) is asked wherever it is seated, in about half the draws as before (per server, decision 0239)."""
    servers = {f"F{block}.{i}": Server(block, block + 1) for block in range(80) for i in range(3)}
    servers |= {"X1": Server(0, 40), "X2": Server(40, 80)}
    manager = FakeManager(servers, 80)
    span = _span("H", 0, 80)
    honest = 0
    for seed in range(50):
        outsiders = StretchReferees(manager, rng=random.Random(seed)).outsiders(span, {"H"})
        asked = outsiders.chains[: OUTSIDERS_MAX + RECORD_SEATS]
        assert len(set().union(*map(hop_paths, asked))) <= HOPS_PER_SEAT * (OUTSIDERS_MAX + RECORD_SEATS), seed
        honest += ("X1", "X2") in [chain.peer_ids for chain in asked]
    assert 12 <= honest <= 38


def test_every_chain_of_few_hops_fits_the_hop_budget_whatever_the_others():
    """`HopBudget.take` (one pass): eleven chains of 80 single-block hops (the attacker's) seated before a chain of two:
    the two-hop chain is asked, with as many of the long ones as the rest of the budget holds (none: 80 > 46), the cut ones in
    their order otherwise."""
    long_chains = [Chain(tuple(_span(f"F{block}.{i}", block, block + 1) for block in range(80))) for i in range(11)]
    short = Chain((_span("X1", 0, 40), _span("X2", 40, 80)))
    budget = HOPS_PER_SEAT * 12
    assert HopBudget(budget).take([*long_chains, short]) == [short]
    fitting = [Chain(tuple(_span(f"G{i}.{hop}", hop, hop + 1) for hop in range(HOPS_PER_SEAT))) for i in range(11)]
    assert HopBudget(budget).take([*long_chains[:1], *fitting, short]) == [*fitting, short]


def _long_chain(hops: int, identities: int, layout: str) -> dict[str, Server]:
    """An honest chain X1 > ... > X`hops` (2 blocks each, over [0, 2 * hops)) and `identities` of an attacker, failing
    every recheck forward, that make chains shorter than it: `front` on X1's and X2's blocks together (0:4), each a
    chain of one hop fewer through X3 on; `branch` half on 0:4, half on 4:8 (X1 and X2's, X3 and X4's blocks), whose
    chains branch at block 4: one and two hops fewer."""
    servers: dict[str, Server] = {f"X{i + 1}": Server(2 * i, 2 * i + 2) for i in range(hops)}
    spans = {"front": [(0, 4)], "branch": [(0, 4), (4, 8)]}[layout]
    servers |= {f"F{i}": Unanswering(*spans[i % len(spans)], inference_rps=1.0) for i in range(identities)}
    return servers


LONG_CHAINS = [  # (the honest chain's hops, the attacker's identities, their layout, verified steps each)
    pytest.param(5, 12, "front", 1, id="5_hops-12_front-1_step_each"),
    pytest.param(5, 32, "front", 1, id="5_hops-32_front-1_step_each"),
    pytest.param(8, 4, "branch", 1, id="8_hops-4_branch-1_step_each"),
    pytest.param(8, 12, "front", 0, id="8_hops-12_front-fresh"),
    pytest.param(8, 32, "front", 0, id="8_hops-32_front-fresh"),
]


@pytest.mark.parametrize("honest", ["standing", "record"])
@pytest.mark.parametrize(("hops", "identities", "layout", "cheap_record"), LONG_CHAINS)
def test_an_honest_chain_of_more_than_four_hops_is_asked_beside_shorter_attacker_chains(
    hops, identities, layout, cheap_record, honest
):
    """Decision 0254 (0250's Left). Honest servers hold 2 blocks each, so their one chain over H's blocks is 5 or 8
    hops (X1 > ... > X8), with a witness's standing or a record of 2 verified steps; the attacker's identities (fresh,
    or one verified step each: into the record seats) make chains of fewer hops beside it. 0250 spent the recheck's 48
    hop forwards fewest hops first over every seat: 7 chains of 7 hops (42) cut an 8-hop chain, 11 of 4 (44) a 5-hop
    one, so main asked X1 > ... > Xh in none of these 100 draws, and a framing resting on two standings banned H
    unrefuted. Now the per-server seats get 4 hops each, fewest hops first, and what is left (16 at least) goes by
    the record of each chain's weakest server first: the honest chain is asked in every draw, and a recheck never asks
    more than 48 hop forwards."""
    servers = _long_chain(hops, identities, layout)
    manager = FakeManager(servers, 2 * hops)
    honest_chain = tuple(f"X{i + 1}" for i in range(hops))
    if honest == "standing":
        vouch(manager, *honest_chain)
    else:
        _record(manager, 2, *honest_chain)
    _record(manager, cheap_record, *(peer for peer in servers if peer.startswith("F")))
    span = _span("H", 0, 2 * hops)
    for seed in range(100):
        outsiders = StretchReferees(manager, rng=random.Random(seed)).outsiders(span, {"H"})
        assert honest_chain in [chain.peer_ids for chain in outsiders.chains], seed
        assert len(set().union(*map(hop_paths, outsiders.chains))) <= HOPS_PER_SEAT * (OUTSIDERS_MAX + RECORD_SEATS)


@pytest.mark.parametrize(
    ("hops", "identities", "layout", "cheap_record", "honest", "seed"),
    [
        pytest.param(5, 32, "front", 1, "standing", 7, id="5_hops-32_front-1_step_each-standing"),
        pytest.param(5, 32, "front", 1, "record", 0, id="5_hops-32_front-1_step_each-record"),
        pytest.param(8, 4, "branch", 1, "standing", 0, id="8_hops-4_branch-1_step_each-standing"),
        pytest.param(8, 12, "front", 0, "standing", 0, id="8_hops-12_front-fresh-standing"),
        pytest.param(8, 32, "front", 0, "record", 0, id="8_hops-32_front-fresh-record"),
    ],
)
def test_shorter_attacker_chains_cannot_cut_an_honest_long_chain_out_of_a_framing(
    hops, identities, layout, cheap_record, honest, seed
):
    """Decision 0254, end to end. SA and SB (one attacker, both with standing) frame H (the whole span) with the same
    made-up outputs; X1 > ... > Xh (2 blocks each) honest, with standing or a record of 2 steps, and a second server of
    each of their spans (X1b...: no record, so a session can be verified past the framing); the attacker's identities
    as in the test above, failing every recheck forward. Main cut every honest chain (each longer than the
    attacker's) and the silent rest left "unchecked" on two standings: H banned for good (these seeds; 5 and 6 of 20
    runs with 5 hops and 32 identities, 19 of 20 with 4 identities on 8 hops, 17 and 20 of 20 with 12 and 32). Now
    X1 > ... > Xh refutes the framers: nobody banned, SA and SB lose their standing."""
    torch.manual_seed(6)
    span = 2 * hops
    servers = {**_framers(span), **_long_chain(hops, identities, layout)}
    servers |= {f"X{i + 1}b": Server(2 * i, 2 * i + 2) for i in range(hops)}
    manager = framed_client(servers, "SA", "SB", num_blocks=span)
    honest_chain = [f"X{i + 1}" for i in range(hops)]
    if honest == "standing":
        vouch(manager, *honest_chain)
    else:
        _record(manager, 2, *honest_chain)
    _record(manager, cheap_record, *(peer for peer in servers if peer.startswith("F")))
    run_framed(manager, torch.randn(1, 6, HIDDEN), FramersFirstDrawn(seed))
    assert not manager.bans.is_liar("H") and not manager.bans.is_banned("H"), manager.bans.banned_peers()
    assert all(servers[peer].forward_calls for peer in honest_chain)
    assert not trusted(manager, "SA") and not trusted(manager, "SB") and {"SA", "SB"} <= manager.avoided_peers()


def test_a_hop_budget_spent_in_passes_takes_the_first_ranked_chains_of_what_is_left():
    """`HopBudget.take`: a first pass (the per-server seats, 4 hops each: 32) fewest hops first takes eight 4-hop
    chains and cuts the 8-hop one; the second, with the 16 left of 48, takes the cut chains by `first` (lowest first),
    fewest hops first among equals: the 8-hop one ranked first and two of three 4-hop ones ranked after it, where
    fewest hops first alone (one pass) takes the three 4-hop ones and cuts the 8-hop one."""
    short = [Chain(tuple(_span(f"F{i}.{hop}", hop, hop + 1) for hop in range(4))) for i in range(8)]
    long = Chain(tuple(_span(f"X{hop}", hop, hop + 1) for hop in range(8)))
    recorded = [Chain(tuple(_span(f"R{i}.{hop}", hop, hop + 1) for hop in range(4))) for i in range(3)]
    budget = HopBudget(HOPS_PER_SEAT * 12)
    assert budget.take([long, *short], up_to=HOPS_PER_SEAT * 8) == short
    assert budget.take([*recorded, long], first=lambda chain: (chain is not long,)) == [*recorded[:2], long]
    assert len(budget.spent) == 48
    assert HopBudget(HOPS_PER_SEAT * 12).take([*short, long, *recorded]) == [*short, *recorded]

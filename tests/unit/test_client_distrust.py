"""Clients that do not trust servers (in-process fake servers, no network): NaN, finite garbage, wrong shapes and
dtypes are failures of the server that produced them (banned, replaced, history replayed), never of the next one;
sampled verification outvotes a liar; a span with no honest server ends in NoHonestServerError within max_wait_s."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch
from hivemind.proto import runtime_pb2
from tests.helpers.hostile_server import corrupt

from corolla.client.calls.output_checks import BadServerOutput, check_outputs, relative_error, verify_rtol
from corolla.client.calls.retries import RetryBudget
from corolla.client.config import ClientConfig
from corolla.client.session.inference_session import InferenceSession
from corolla.client.training.remote_sequential import RemoteSequential
from corolla.client.verification.step_verifier import LONE_TRUST_STEPS
from corolla.client.verification.witnesses import UNCHECKED, Rechecked, outvote, trusted
from corolla.protocol.codecs import deserialize_tensor, serialize_tensor
from corolla.protocol.metadata import decode_metadata
from corolla.protocol.packing import unpack_args_kwargs
from corolla.utils.errors import MissingBlocksError, NoHonestServerError
from helpers.fake_chain import HIDDEN, FakeManager, FakeServer, block_fn, reference, vouch
from helpers.framed_session import framed_client, run_framed


class Server(FakeServer):
    """A fake server that rejects non-finite inputs (as real servers do), answers rpc_forward too, and, with a
    `mode` of `tests.helpers.hostile_server.corrupt`, lies in every answer after the first `after`."""

    def __init__(self, start: int, end: int, mode: str = "honest", after: int = 0, inference_rps: float = 100.0):
        super().__init__(start, end, inference_rps)
        self.mode, self.after, self.answers = mode, after, 0
        self.rejected_inputs = 0
        self.forward_calls = 0
        self.generator = torch.Generator().manual_seed(0)

    def _lie(self, tensor: torch.Tensor) -> torch.Tensor:
        self.answers += 1
        if self.mode == "honest" or self.answers <= self.after:
            return tensor
        return corrupt(tensor, self.mode, self.generator)

    async def _serve(self, requests):
        async def checked():
            async for request in requests:
                if request.tensors and not bool(torch.isfinite(deserialize_tensor(request.tensors[0])).all()):
                    self.rejected_inputs += 1
                    raise ValueError("hidden states must be finite")
                yield request

        async for response in super()._serve(checked()):
            yield runtime_pb2.ExpertResponse(
                tensors=[serialize_tensor(self._lie(deserialize_tensor(response.tensors[0])))]
            )

    async def rpc_forward(self, request, timeout=None):
        self.forward_calls += 1
        if self.dead:
            raise ConnectionError("server died")
        metadata = decode_metadata(request.metadata)
        args, _ = unpack_args_kwargs([deserialize_tensor(t) for t in request.tensors], metadata["args_structure"])
        x, prompts = args[0], args[1]
        if not bool(torch.isfinite(x).all()):
            self.rejected_inputs += 1
            raise ValueError("hidden states must be finite")
        for i, uid in enumerate(request.uid.split(" ")):
            if prompts.numel():  # deep prompts [blocks, B|1, P, H], added to positions [0, P) as Petals does
                x = x.clone()
                x[:, : prompts.shape[2]] += prompts[i]
            x = block_fn(int(uid.split(".")[1]), x, x[:, :0])
        return runtime_pb2.ExpertResponse(tensors=[serialize_tensor(self._lie(x))])


def _generate(manager, tokens: torch.Tensor, max_length: int | None = None) -> torch.Tensor:
    outputs = []
    with InferenceSession(manager, max_length=max_length or tokens.shape[1]) as session:
        outputs.append(session.step(tokens[:, :4]))
        for t in range(4, tokens.shape[1]):
            outputs.append(session.step(tokens[:, t : t + 1]))
    return torch.cat(outputs, dim=1)


@pytest.mark.parametrize("mode", ["nan", "shape", "dtype"])
def test_bad_first_span_output_bans_its_server_not_the_downstream_one(mode):
    torch.manual_seed(0)
    # the liar looks fastest, so the route goes through it first; it lies from its 3rd answer on
    servers = {"liar": Server(0, 2, mode, after=2, inference_rps=1e6), "A2": Server(0, 2), "B": Server(2, 4)}
    manager = FakeManager(servers, 4, max_wait_s=10)
    tokens = torch.randn(1, 10, HIDDEN)
    out = _generate(manager, tokens)
    torch.testing.assert_close(out, reference(tokens, 4), atol=1e-5, rtol=0)
    assert servers["liar"].answers >= 3  # it was used and lied
    assert manager.bans.is_banned("liar")
    assert not manager.bans.is_banned("B") and servers["B"].rejected_inputs == 0


def test_finite_garbage_is_caught_by_verification_and_the_liar_banned():
    torch.manual_seed(1)
    servers = {
        "liar": Server(0, 2, "garbage", after=3, inference_rps=1e6),
        "A2": Server(0, 2),
        "A3": Server(0, 2),
        "B": Server(2, 4),
        "B2": Server(2, 4),  # every step is verified: a lone server of 2:4 would be waited for, not trusted
    }
    tokens = torch.randn(1, 10, HIDDEN)
    manager = framed_client(servers, "A2", "A3", "B", "B2")  # witnesses with standing (decision 0190)
    framed = run_framed(manager, tokens)
    # 7 steps of each span verified, and the rejected one of 0:2
    assert framed.num_rejected == 1 and framed.num_verified == 15
    assert manager.bans.is_banned("liar") and not manager.bans.banned_peers() & {"A2", "A3", "B", "B2"}


def _made_up(like: torch.Tensor) -> torch.Tensor:
    return torch.randn(like.shape, generator=torch.Generator().manual_seed(11), dtype=like.dtype)


class Framer(Server):
    """One of an attacker's free identities: as a referee (`rpc_forward`) answers made-up outputs, the same on every
    such identity (they agree with each other, against the server verified); serves sessions honestly, or with
    `serves_lies` the same made-up outputs there too."""

    serves_lies = False

    async def _serve(self, requests):
        async for response in super()._serve(requests):
            if self.serves_lies:
                response = runtime_pb2.ExpertResponse(
                    tensors=[serialize_tensor(_made_up(deserialize_tensor(response.tensors[0])))]
                )
            yield response

    async def rpc_forward(self, request, timeout=None):
        honest = deserialize_tensor((await super().rpc_forward(request, timeout)).tensors[0])
        return runtime_pb2.ExpertResponse(tensors=[serialize_tensor(_made_up(honest))])


class FramersFirst(random.Random):
    """Shuffles the framers ahead of every other referee: the draw the attack hopes for."""

    def shuffle(self, x: list) -> None:  # type: ignore[override]
        x.sort(key=lambda span: not span.peer_id.startswith("S"))


def test_two_fresh_identities_refereeing_cannot_get_an_honest_server_banned():
    """Decision 0190. H (honest, routed first) is verified by S1 and S2, one attacker's two fresh identities that
    answer the same made-up outputs: 2:1 against H. Main banned H for good (its sessions then went through the
    attacker's identities). Now two witnesses short of standing only get H avoided; they are watched: every step of
    theirs is verified, by others first (H2, the one honest referee left, checks them); H is no liar and the
    outputs are the reference's (the framers serve honestly: they lie only as referees)."""
    torch.manual_seed(6)
    servers = {
        "H": Server(0, 2, inference_rps=1e6),
        "S1": Framer(0, 2, inference_rps=1e4),
        "S2": Framer(0, 2, inference_rps=1e4),
        "H2": Server(0, 2),
        "B": Server(2, 4),
        "B2": Server(2, 4),
    }
    tokens = torch.randn(1, 10, HIDDEN)
    manager = framed_client(servers)
    route = run_framed(manager, tokens, FramersFirst()).route
    assert not manager.bans.is_liar("H") and not manager.bans.is_banned("H"), manager.bans.banned_peers()
    assert "H" in manager.avoided_peers() and manager.disputes.watched() == {"S1", "S2"}
    assert route[0] in ("S1", "S2")
    # the framers referee only the first vote (never each other); H2 checked every later step of theirs
    assert servers["S1"].forward_calls + servers["S2"].forward_calls == 2
    assert servers["H2"].forward_calls == 7  # the replayed prompt and 6 decode steps


def test_two_fresh_identities_serving_their_lie_vouch_for_nothing():
    """Decision 0190. The framers of the test above also serve their made-up outputs. Once H is avoided, S1 serves
    (watched): H2 disagrees, S2 (its co-witness, asked last) agrees: one witness each, so S1's outputs are not used
    and it is avoided; S2 then disagrees with H2 alone. No wrong output is ever returned (the step ends in
    NoHonestServerError or the reference's outputs), and neither H nor H2 is banned as a liar. Main banned H, then
    took S1's made-up outputs on S2's word."""
    torch.manual_seed(6)
    servers = {
        "H": Server(0, 2, inference_rps=1e6),
        "S1": Framer(0, 2, inference_rps=1e4),
        "S2": Framer(0, 2, inference_rps=1e3),
        "H2": Server(0, 2),
        "B": Server(2, 4),
        "B2": Server(2, 4),
    }
    for name in ("S1", "S2"):
        servers[name].serves_lies = True  # type: ignore[attr-defined]
    tokens = torch.randn(1, 4, HIDDEN)
    manager = FakeManager(servers, 4, max_wait_s=2, verify_fraction=1.0)
    try:
        with InferenceSession(manager, max_length=4) as session:
            session.verifier.rng = FramersFirst()
            outputs = session.step(tokens)
    except NoHonestServerError:
        outputs = None
    if outputs is not None:
        torch.testing.assert_close(outputs, reference(tokens, 4), atol=1e-5, rtol=0)
    assert not manager.bans.is_liar("H") and not manager.bans.is_liar("H2")
    assert {"H", "S1"} <= manager.avoided_peers()


class Lender(Framer):
    """An attacker's identity that earns standing first: as a referee it answers honestly until `honest_answers`
    were asked of it (each verified step agreeing with the server verified), then the framers' made-up outputs."""

    def __init__(self, start: int, end: int, honest_answers: int, inference_rps: float = 100.0):
        super().__init__(start, end, inference_rps=inference_rps)
        self.honest_answers = honest_answers

    async def rpc_forward(self, request, timeout=None):
        if self.forward_calls < self.honest_answers:
            return await Server.rpc_forward(self, request, timeout)
        return await super().rpc_forward(request, timeout)


def _lend_standing(outside: dict[str, Server]) -> tuple[FakeManager, dict[str, Server], int]:
    """Decision 0208's attack, run: H (honest, routed first) is refereed by SA (`Lender`: honest until it has a
    witness's standing, then made-up outputs) and SB (a fresh `Framer`), drawn first, with `outside` the other servers
    of 0:2 (B and B2 serve 2:4), one session of 4 + standing + 3 tokens. Returns the client, the servers and SA's
    standing once its 8th honest answer was in (the standing the attack spends next)."""
    torch.manual_seed(6)
    standing = ClientConfig().witness_standing_steps
    servers = {
        "H": Server(0, 2, inference_rps=1e6),
        "SA": Lender(0, 2, honest_answers=standing, inference_rps=1e4),
        "SB": Framer(0, 2, inference_rps=1e4),
        **outside,
        "B": Server(2, 4),
        "B2": Server(2, 4),
    }
    tokens = torch.randn(1, 4 + standing + 3, HIDDEN)
    manager = framed_client(servers)
    earned = []

    def after_step(t: int) -> None:
        if t == 4 + standing - 2:
            earned.append(manager.bans.agreed_in_a_row("SA"))

    run_framed(manager, tokens, FramersFirst(), after_step=after_step)
    return manager, servers, earned[0]


def test_standing_earned_by_one_identity_is_not_lent_to_a_fresh_one():
    """Decision 0208 (0190's Left). SA, an attacker's identity, referees H (honest, routed first) honestly until it has
    a witness's standing (8 verified steps agreeing with H), then answers made-up outputs, and SB, a fresh identity of
    the same attacker, the same: SA's standing and SB's agreement outvote H 2:1. Main banned H for good (and would
    for every honest server SA referees, with any fresh partner). Now an outside server (H2, drawn by the client)
    recomputes before a ban: it sides with H, so nobody is banned, SA and SB lose their standing and are avoided,
    and the outputs stay the reference's."""
    standing = ClientConfig().witness_standing_steps
    manager, servers, earned = _lend_standing({"H2": Server(0, 2), "H3": Server(0, 2)})
    assert earned == standing  # SA's 8th honest answer was in: the standing the attack spends next
    assert servers["SA"].forward_calls > standing  # it lied after earning standing
    assert not manager.bans.is_liar("H") and not manager.bans.is_banned("H"), manager.bans.banned_peers()
    assert not manager.bans.agreed_in_a_row("SA") and {"SA", "SB"} <= manager.avoided_peers()


class Refusing(Server):
    """An honest server whose stream total the attacker filled when it framed (0187's reserve taken one message per
    free identity, held whole while its handler is busy): it refuses the client's first stateless forward as a full
    server, retry later, and answers honestly once the attacker let go."""

    async def rpc_forward(self, request, timeout=None):
        if not self.forward_calls:
            self.forward_calls += 1
            raise ConnectionError("the server holds its stream total in unfinished requests; retry later")
        return await super().rpc_forward(request, timeout)


def test_an_outsider_kept_busy_by_the_framers_does_not_let_one_standing_ban():
    """Decision 0232 (against 0208's recheck and 0226's rule). SA (standing, earned refereeing H honestly) and SB
    (fresh) outvote H (honest, routed first) with the same made-up outputs; H2, the one honest server outside them,
    would refute them, but the attacker, which chooses when it frames, has filled H2's stream total at that moment, so
    H2 refuses the client's recheck. Main counted a refused outsider as no answer: "unchecked", H banned for good on
    SA's standing alone. Now a ban that would rest on one standing while an outsider asked did not answer is none: H
    avoided, SA and SB watched (SA's standing not spent: nothing was decided), the outputs the reference's."""
    standing = ClientConfig().witness_standing_steps
    manager, servers, _ = _lend_standing({"H2": Refusing(0, 2)})
    assert servers["SA"].forward_calls > standing and servers["H2"].forward_calls  # it framed; H2 was asked
    assert not manager.bans.is_liar("H") and not manager.bans.is_banned("H"), manager.bans.banned_peers()
    assert "H" in manager.avoided_peers() and {"SA", "SB"} <= manager.disputes.watched()


class Drawn(random.Random):
    """Draws referees and outside servers in the order of `order` (the rest after them), for one session: which
    honest servers witness a lie and which rechecks it, fixed."""

    def __init__(self, order: list[str]):
        super().__init__(0)
        self.order = order

    def shuffle(self, x: list) -> None:  # type: ignore[override]
        x.sort(key=lambda span: self.order.index(span.peer_id) if span.peer_id in self.order else len(self.order))


@pytest.mark.parametrize(
    "draws",
    [
        [["H1", "H2", "H3"], ["H3", "H1", "H2"], ["H2", "H3", "H1"]],  # two witnesses, then the outsider
        [["H1", "H2"], ["H2", "H1"], ["H1", "H2"]],  # nobody outside the dispute
    ],
    ids=["an_outsider_with_standing", "none_outside"],
)
def test_fresh_liars_outvoted_do_not_drain_the_honest_witnesses_standing(draws):
    """Decision 0226 (issue 37; 0208's spending attacked). H1, H2 (and H3) are honest servers this client verified
    before (each with a witness's standing). Fresh identities F0 and F1 (free) each serve one session's first step
    with garbage, the fastest of the span: two of the honest servers outvote it (the third, outside, rechecks and
    confirms), and it is banned for good. Main spent the standing of the witnesses of each ban, though it rested on
    two standings or three: after the two liars (rotating which honest servers witness and which rechecks), no
    honest server had standing, and the real liar L that came next, outvoted by two of them, was only avoided
    (300 s, then back) instead of banned. Now a ban carried by two standings or more spends none: every honest
    server keeps its standing and L is banned for good; every session's outputs are the reference's."""
    torch.manual_seed(7)
    honest = tuple(draws[0])
    servers = {name: Server(0, 2) for name in honest} | {"B": Server(2, 4), "B2": Server(2, 4)}
    tokens = torch.randn(1, 4, HIDDEN)
    manager = framed_client(servers, *honest, "B", "B2")  # (a client that verified them before)

    def session(liar: str, order: list[str]) -> None:
        servers[liar] = Server(0, 2, "garbage", inference_rps=1e6)  # the fastest: routed first, lies at once
        manager.update()
        run_framed(manager, tokens, Drawn(order))

    for liar, order in zip(("F0", "F1"), draws[:2], strict=True):
        session(liar, order)
        assert manager.bans.is_liar(liar), (liar, manager.avoided_peers())
    assert {peer: trusted(manager, peer) for peer in honest} == dict.fromkeys(honest, True), {
        peer: manager.bans.agreed_in_a_row(peer) for peer in honest
    }
    session("L", draws[2])
    assert manager.bans.is_liar("L"), manager.avoided_peers()
    assert not manager.bans.banned_peers() & set(honest) and not manager.avoided_peers() & set(honest)


@pytest.mark.parametrize(
    ("partner", "rechecked", "spent"),
    [
        ("SB", UNCHECKED, True),  # nobody outside answered: the ban rests on SA's standing alone (0208)
        ("SB", Rechecked("confirmed", (("SC",),)), True),  # confirmed by fresh outsiders only: maybe the attacker's
        ("SB", Rechecked("confirmed", (("SC",), ("H3",))), False),  # an outsider with standing confirmed too (0226)
        ("SB", Rechecked("confirmed", (("H3", "SC"),)), True),  # a chain with a fresh hop: no second standing (0234)
        ("H4", UNCHECKED, False),  # both witnesses with standing (0226)
    ],
    ids=[
        "unchecked",
        "fresh_outsiders",
        "an_outsider_with_standing",
        "a_chain_with_a_fresh_hop",
        "both_witnesses_with_standing",
    ],
)
def test_a_ban_on_one_standing_spends_it_and_on_two_spends_none(partner, rechecked, spent):
    """Decision 0226 (0208's spending kept where it is the backstop): SA (standing) and `partner` outvote X, which is
    banned for good either way. SA's standing is spent where the ban rests on it alone (a fresh partner, no outside
    server with standing among those that confirmed): SA with fresh identities of its own as the partner and the
    outsiders (or none outside) still bans once per standing earned."""
    servers = {name: Server(0, 2) for name in ("X", "SA", "SB", "SC", "H3", "H4")} | {"B": Server(2, 4)}
    manager = FakeManager(servers, 4)
    vouch(manager, "SA", "H3", "H4")
    assert outvote(manager, "X", ["SA", partner], "test", rechecked=rechecked)
    assert manager.bans.is_liar("X") and trusted(manager, "SA") is not spent and trusted(manager, "H3")


def test_without_verification_finite_garbage_goes_unnoticed():
    """The attack the verification above defeats: nothing else can tell finite garbage from real outputs."""
    torch.manual_seed(1)
    servers = {"liar": Server(0, 2, "garbage", after=3, inference_rps=1e6), "A2": Server(0, 2), "B": Server(2, 4)}
    tokens = torch.randn(1, 10, HIDDEN)
    out = _generate(FakeManager(servers, 4, max_wait_s=10), tokens)
    assert relative_error(out[:, -1], reference(tokens, 4)[:, -1]) > 0.05


def test_verification_without_a_majority_bans_both_and_with_a_lone_server_logs_once(caplog):
    torch.manual_seed(2)
    tokens = torch.randn(1, 6, HIDDEN)
    servers = {"liar": Server(0, 2, "garbage", inference_rps=1e6), "A2": Server(0, 2), "B": Server(2, 4)}
    manager = FakeManager(servers, 4, max_wait_s=0.5, verify_fraction=1.0)
    with pytest.raises(NoHonestServerError), InferenceSession(manager, max_length=6) as session:
        session.step(tokens[:, :4])
    assert {"liar", "A2"} <= manager.bans.banned_peers() and not manager.bans.is_banned("B")

    # below 1.0 a lone server's outputs are trusted (sampling deters; it cannot check): 0.999 samples nearly all
    manager = FakeManager({"A": Server(0, 2), "B": Server(2, 4)}, 4, verify_fraction=0.999)
    with caplog.at_level("WARNING", logger="corolla.client.verification.step_verifier"):
        out = _generate(manager, tokens)
    torch.testing.assert_close(out, reference(tokens, 4), atol=1e-5, rtol=0)
    lone = [r for r in caplog.records if "single_server" in r.getMessage()]
    assert len(lone) == 2  # once per span (0:2 and 2:4), not once per step


def test_every_step_verified_waits_for_a_second_server_instead_of_trusting_a_lone_liar():
    """verify_fraction=1.0 promises every output checked: with the liar the only server of its blocks (its honest
    replicas down), the step waits (bounded) and ends in NoHonestServerError, never in the liar's garbage; the lone
    server is not banned (a second server may come back, and it may be honest)."""
    torch.manual_seed(3)
    tokens = torch.randn(1, 6, HIDDEN)
    manager = FakeManager({"liar": Server(0, 2, "garbage"), "B": Server(2, 4)}, 4, max_wait_s=0.5, verify_fraction=1.0)
    with pytest.raises(NoHonestServerError, match="cannot be verified"), InferenceSession(manager, 6) as session:
        session.step(tokens[:, :4])
    assert not manager.bans.is_banned("liar")


def test_a_lone_server_is_trusted_on_a_record_of_agreeing_and_never_after_being_outvoted():
    """At verify_fraction=1.0 the server left alone is used when its last LONE_TRUST_STEPS verified outputs agreed
    with other servers; a server once outvoted 2:1 is banned for good and never trusted alone."""
    torch.manual_seed(4)
    tokens = torch.randn(1, 6, HIDDEN)
    servers = {"A": Server(0, 2), "B": Server(2, 4)}
    manager = FakeManager(servers, 4, max_wait_s=0.5, verify_fraction=1.0)
    for _ in range(LONE_TRUST_STEPS):
        manager.bans.record_verified("A", agreed=True)
        manager.bans.record_verified("B", agreed=True)
    manager.bans.record_verified("B", agreed=False)  # one disagreement: B's record starts over
    with pytest.raises(NoHonestServerError, match="blocks 2:4"), InferenceSession(manager, 6) as session:
        session.step(tokens[:, :4])
    for _ in range(LONE_TRUST_STEPS):
        manager.bans.record_verified("B", agreed=True)
    torch.testing.assert_close(_generate(manager, tokens), reference(tokens, 4), atol=1e-5, rtol=0)

    # an outvoted server is a liar for good: no record makes it trusted alone
    liar_servers = {"liar": Server(0, 2, "garbage", inference_rps=1e6), "A2": Server(0, 2), "A3": Server(0, 2),
                    "B": Server(2, 4), "B2": Server(2, 4)}  # fmt: skip
    manager = FakeManager(liar_servers, 4, max_wait_s=10, verify_fraction=1.0)
    vouch(manager, "A2", "A3")  # witnesses with standing (decision 0190)
    _generate(manager, tokens)
    assert manager.bans.is_liar("liar")
    for _ in range(LONE_TRUST_STEPS):
        manager.bans.record_verified("liar", agreed=True)
    assert manager.bans.agreed_in_a_row("liar") == 0


@pytest.mark.parametrize("mode", ["nan", "refuse", "hang"])
def test_lone_bad_server_ends_in_a_clear_error_within_max_wait(mode):
    torch.manual_seed(3)
    liar = Server(0, 2, "nan" if mode == "nan" else "honest")
    liar.dead = mode == "refuse"
    liar.hung = mode == "hang"
    servers = {"liar": liar, "B": Server(2, 4)}
    manager = FakeManager(servers, 4, max_wait_s=1.5, max_backoff_s=0.2, liveness_check_period_s=0.2)
    started = time.monotonic()
    with pytest.raises(NoHonestServerError) as info, InferenceSession(manager, max_length=6) as session:
        session.step(torch.randn(1, 4, HIDDEN))
    elapsed_s = time.monotonic() - started
    assert 1.5 <= elapsed_s < 6.0, elapsed_s
    message = str(info.value)
    assert "blocks 0:2" in message and "...liar" in message and info.value.missing == [0, 1]
    assert isinstance(info.value, MissingBlocksError)  # what corolla-api and corolla-generate report
    assert not manager.bans.is_banned("B")


def test_missing_blocks_end_after_max_wait_not_forever():
    manager = FakeManager({"A": Server(0, 2)}, 4, max_wait_s=1.0, max_backoff_s=0.3)
    started = time.monotonic()
    with pytest.raises(NoHonestServerError, match=r"blocks 2:4") as info:
        with InferenceSession(manager, max_length=4) as session:
            session.step(torch.randn(1, 2, HIDDEN))
    assert 1.0 <= time.monotonic() - started < 5.0
    assert info.value.missing == [2, 3]


def test_forward_backward_bad_outputs_fail_their_server():
    torch.manual_seed(4)
    servers = {"liar": Server(0, 2, "nan", inference_rps=1e6), "A2": Server(0, 2), "B": Server(2, 4)}
    manager = FakeManager(servers, 4, max_wait_s=10)
    remote = RemoteSequential(manager)
    x = torch.randn(2, 5, HIDDEN)
    for _ in range(40):  # max-throughput routing is random: try until the liar was picked at least once (6 tries
        # missed it once in a full run)
        torch.testing.assert_close(remote(x), reference(x, 4), atol=1e-5, rtol=0)
        if servers["liar"].forward_calls:
            break
    assert servers["liar"].forward_calls and manager.bans.is_banned("liar")
    assert servers["B"].rejected_inputs == 0 and not manager.bans.is_banned("B")


def test_check_outputs_and_tolerances():
    good = torch.randn(1, 3, 4)
    assert check_outputs(good, expected_shape=(1, 3, 4), peer_id="p", what="x") is good
    for bad, match in [
        (good[..., :3], "shape"),
        (good.to(torch.float64), "dtype"),
        ((good * 10).int(), "dtype"),
        (torch.where(good > 0, torch.inf, good), "non-finite"),
    ]:
        with pytest.raises(BadServerOutput, match=match):
            check_outputs(bad, expected_shape=(1, 3, 4), peer_id="p", what="x")
    assert verify_rtol(torch.float32) == pytest.approx(1e-3)
    assert verify_rtol(torch.float32, torch.bfloat16) == pytest.approx(0.25)
    assert verify_rtol(torch.float16) == pytest.approx(32 * 2**-10)
    assert relative_error(good, good + 1e-6) < 1e-5 and relative_error(good, torch.randn(1, 3, 4)) > 0.3


def test_retry_budget_counts_time_from_the_first_failure_and_resets_on_success():
    now = [0.0]
    manager = FakeManager({"A": Server(0, 1)}, 1, max_wait_s=10.0, min_backoff_s=1.0, max_backoff_s=8.0)
    budget = RetryBudget(manager, clock=lambda: now[0])
    error = ConnectionError("boom")
    assert budget.on_failure(error, "A", (0, 1)) == 0.0
    now[0] = 9.5
    assert budget.on_failure(error, "A", (0, 1)) == pytest.approx(0.5)  # capped at the deadline
    budget.on_success()
    now[0] = 100.0
    assert budget.on_failure(error, None, (0, 1)) == 0.0  # a fresh budget
    now[0] = 110.0
    with pytest.raises(NoHonestServerError, match=r"after 10.0 s"):
        budget.on_failure(error, None, (0, 1))
    with pytest.raises(ValueError, match="max_wait_s"):
        ClientConfig(max_wait_s=-1)
    with pytest.raises(ValueError, match="verify_fraction"):
        ClientConfig(verify_fraction=1.5)
    assert asyncio.iscoroutinefunction(Server.rpc_forward)

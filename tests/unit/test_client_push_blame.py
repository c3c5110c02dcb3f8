"""Who a client blames for a push's answer (in-process fake servers, no network; decision 0169): a server that flags
its lie as the answer to a push it was named for gets one replay in the client's process, not one a session
(`routing.push_suspects`), which names neither server of that push for a while and the pair for longer each time;
an honest server is never banned by it. Outputs legal in the client's dtype but beyond the range of the dtype the
next server announces (float16) are not sent to it (decision 0170): routed around, nobody banned."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from hivemind.p2p import P2PHandlerError
from hivemind.proto import runtime_pb2

from corolla.client.routing.push_suspects import PushSuspects
from corolla.client.session.inference_session import InferenceSession
from corolla.protocol.codecs import check_castable, deserialize_tensor, serialize_tensor
from corolla.protocol.forwarding import PUSHED_FROM_KEY, PUSHED_REPLY_KEY
from corolla.protocol.metadata import decode_metadata, encode_metadata
from corolla.protocol.records import ServerInfo
from corolla.utils.errors import NoHonestServerError
from helpers.fake_chain import HIDDEN, FakeManager, FakeServer, Referee, reference, vouch


class PushTarget(FakeServer):
    """A server a lying upstream's push may reach, announced fastest (every route goes through it): `corolla`: its
    record has corolla's load fields (it flags), else a stock Petals server's (none); `_named(step_id)`: the client
    named it, in its upstream's request for that step, to receive the step by push."""

    def __init__(self, peer_id: str, start: int, end: int, upstream: FakeServer, *, corolla: bool):
        super().__init__(start, end, inference_rps=1e6)
        self.peer_id, self.upstream, self.corolla = peer_id, upstream, corolla

    def server_info(self) -> ServerInfo:
        info = super().server_info()
        info.tokens_served = 0 if self.corolla else None
        return info

    def _named(self, step_id: str) -> bool:
        return any(
            metadata.get("step_id") == step_id
            and any(hop[0] == self.peer_id for hop in metadata.get("next_servers", ()))
            for metadata, _ in self.upstream.requests
        )


class PushAnswerer(PushTarget):
    """Answers a step the client named it to receive by push (the upstream's request for that step named it in
    `next_servers`: a fake's view of what its upstream pushes) with one token more, what a server answers to a push
    of one token more than the client's step (the push rules allow up to its prefill, decision 0154); every other
    step truly (a replay in a new session too: never pushed). `corolla`: its record has corolla's load fields, else
    a stock Petals server's (none); `flags`: it flags that answer as the push's, from the client's own start. A
    flagging one is a liar (it made the lie up, or it could not flag it); a stock one is an honest server fed a
    lying upstream's push (it flags nothing)."""

    def __init__(
        self, peer_id: str, start: int, end: int, upstream: FakeServer, *, corolla: bool = True, flags: bool = True
    ):
        super().__init__(peer_id, start, end, upstream, corolla=corolla)
        self.flags = flags
        self.lies = 0

    async def _serve(self, requests):
        seen: list[dict] = []

        async def tapped():
            async for request in requests:
                if request.tensors:
                    seen.append(decode_metadata(request.metadata))
                yield request

        async for response in super()._serve(tapped()):
            metadata = seen[-1]
            if len(seen) > 1 and self._named(metadata["step_id"]):  # (a session's first step is never pushed)
                self.lies += 1
                outputs = deserialize_tensor(response.tensors[0])  # [B, T, H]
                flags = {PUSHED_REPLY_KEY: True, PUSHED_FROM_KEY: metadata["start_from_position"]}
                response = runtime_pb2.ExpertResponse(
                    tensors=[serialize_tensor(torch.cat([outputs, outputs[:, -1:]], dim=1))],
                    metadata=encode_metadata(flags) if self.flags else b"",
                )
            yield response


def _generate(manager: FakeManager, tokens: torch.Tensor) -> torch.Tensor:
    with InferenceSession(manager, max_length=tokens.shape[1]) as session:
        steps = [session.step(tokens[:, :4])] + [session.step(tokens[:, t : t + 1]) for t in range(4, tokens.shape[1])]
    return torch.cat(steps, dim=1)


def test_a_liar_flagging_its_lies_as_a_push_answer_gets_one_replay_not_one_a_session():
    """Before: every session named the liar for its second step's push, took the flagged lie as the push's fault
    (no ban), replayed, and forwarded no more in that session only: N sessions, N lies and N replays."""
    torch.manual_seed(0)
    upstream = FakeServer(0, 2)
    liar = PushAnswerer("liar", 2, 4, upstream)
    servers = {"A": upstream, "liar": liar, "B": FakeServer(2, 4)}
    manager = FakeManager(servers, 4, max_wait_s=10)
    tokens = torch.randn(1, 7, HIDDEN)
    for _ in range(4):
        outputs = _generate(manager, tokens)
        torch.testing.assert_close(outputs, reference(tokens, 4), atol=1e-5, rtol=0)
    assert liar.lies == 1, liar.lies
    assert manager.push_suspects.failures("A", "liar") == 1
    assert not manager.bans.banned_peers()  # nobody is banned for it (it is not told from an upstream's lie)
    assert not manager.push_suspects.may_push("A", "B")  # A was the other party: no push out of it for a while


def test_a_stock_server_answering_a_push_of_more_tokens_is_not_banned():
    """A stock Petals server flags nothing: its answer to a lying upstream's push of one token more looked like its
    own lie, and the client banned it (decision 0154's left); now a failing reply of a server named for this step's
    push that cannot flag blames nobody, like a flagged one, and the pair is suspended the same way."""
    torch.manual_seed(0)
    upstream = FakeServer(0, 2)
    stock = PushAnswerer("stock", 2, 4, upstream, corolla=False, flags=False)
    manager = FakeManager({"A": upstream, "stock": stock, "B": FakeServer(2, 4)}, 4, max_wait_s=10)
    tokens = torch.randn(1, 7, HIDDEN)
    for _ in range(3):
        torch.testing.assert_close(_generate(manager, tokens), reference(tokens, 4), atol=1e-5, rtol=0)
    assert stock.lies == 1 and not manager.bans.banned_peers()
    assert manager.push_suspects.failures("A", "stock") == 1


def test_a_corolla_server_failing_unflagged_is_its_own_failure():
    """A corolla server flags its answers to pushes: one it does not flag is its own, named for a push or not."""
    torch.manual_seed(0)
    upstream = FakeServer(0, 2)
    liar = PushAnswerer("liar", 2, 4, upstream, flags=False)
    manager = FakeManager({"A": upstream, "liar": liar, "B": FakeServer(2, 4)}, 4, max_wait_s=10)
    tokens = torch.randn(1, 7, HIDDEN)
    torch.testing.assert_close(_generate(manager, tokens), reference(tokens, 4), atol=1e-5, rtol=0)
    assert liar.lies == 1 and manager.bans.banned_peers() == {"liar"}
    assert manager.push_suspects.failures("A", "liar") == 0


class RewoundStock(PushTarget):
    """A stock Petals server (no load fields: it flags nothing) fed a lying upstream's push from an earlier start: a
    step the client named it to receive by push runs from position 1 instead of the client's start (Petals takes the
    start a push names), its answer the right shape; the client's next step then starts past its cache, and it
    refuses it (its error, as over p2p)."""

    def __init__(self, peer_id: str, start: int, end: int, upstream: FakeServer, *, corolla: bool = False):
        super().__init__(peer_id, start, end, upstream, corolla=corolla)
        self.rewound = self.refused = 0

    async def _serve(self, requests):
        async def pushed_over():
            first = True
            async for request in requests:
                metadata = decode_metadata(request.metadata) if request.tensors else {}
                if request.tensors and not first and self._named(metadata["step_id"]) and not self.rewound:
                    self.rewound += 1
                    metadata["start_from_position"] = 1
                    request = runtime_pb2.ExpertRequest(
                        uid=request.uid, tensors=request.tensors, metadata=encode_metadata(metadata)
                    )
                first = False
                yield request

        try:
            async for response in super()._serve(pushed_over()):
                yield response
        except AssertionError as e:  # the fake's check of a start past its cache: the server's refusal
            self.refused += 1
            raise P2PHandlerError(f"Failed to call handler `rpc_inference`: {e}") from None


def test_a_stock_server_refusing_after_a_push_rolled_its_cache_back_is_not_banned():
    """0169's Left, closed: a push from an earlier start into a stock server rolls its cache back (its answer to it
    has the right shape: its values are the upstream's lie, unchecked as any push's), and its refusal of the
    client's next step banned it; now a stock server's refusal after pushes were named into it in the span session
    blames nobody and suspends the push, as a failed answer to one."""
    torch.manual_seed(0)
    upstream = FakeServer(0, 2)
    stock = RewoundStock("stock", 2, 4, upstream)
    manager = FakeManager({"A": upstream, "stock": stock, "B": FakeServer(2, 4)}, 4, max_wait_s=10)
    _generate(manager, torch.randn(1, 7, HIDDEN))
    assert stock.rewound == 1 and stock.refused == 1
    assert not manager.bans.banned_peers()
    assert manager.push_suspects.failures("A", "stock") == 1
    # a corolla server says which answers are pushes' and where they started (0154): its refusal is its own
    corolla = RewoundStock("corolla", 2, 4, upstream, corolla=True)
    manager = FakeManager({"A": upstream, "corolla": corolla, "B": FakeServer(2, 4)}, 4, max_wait_s=10)
    _generate(manager, torch.randn(1, 7, HIDDEN))
    assert corolla.refused == 1 and manager.bans.banned_peers() == {"corolla"}


class Clock:
    def __init__(self):
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_a_pairs_suspension_doubles_and_its_servers_come_back_after_one_period():
    clock = Clock()
    suspects = PushSuspects(base_s=60.0, max_s=200.0, clock=clock)
    assert suspects.may_push("U", "D")
    assert suspects.rejected("U", "D") == 60.0
    # neither server is pushed into or out of, with anyone; others are
    assert not suspects.may_push("U", "D") and not suspects.may_push("U", "E") and not suspects.may_push("V", "D")
    assert not suspects.may_push("D", "E") and suspects.may_push("V", "E")
    clock.now_s += 60.0
    assert suspects.may_push("U", "D") and suspects.may_push("U", "E") and suspects.may_push("V", "D")
    assert suspects.rejected("U", "D") == 120.0  # the pair again: twice as long, its servers one period
    clock.now_s += 60.0
    assert not suspects.may_push("U", "D") and suspects.may_push("U", "E") and suspects.may_push("V", "D")
    clock.now_s += 60.0
    assert suspects.may_push("U", "D")
    assert suspects.rejected("U", "D") == 200.0  # capped
    assert suspects.failures("U", "D") == 3 and suspects.failures("D", "U") == 0


def test_a_framer_keeps_an_honest_server_out_of_pushes_one_period_a_failure():
    """A liar L pushing bad outputs into honest D again as soon as it may: D is pushed into from others for all but
    the first period after each of L's failures, which come at doubling intervals."""
    clock = Clock()
    suspects = PushSuspects(base_s=60.0, clock=clock)
    blocked_s = 0
    for second in range(0, 3600, 10):
        clock.now_s = 1000.0 + second
        if suspects.may_push("L", "D"):
            suspects.rejected("L", "D")
        blocked_s += 0 if suspects.may_push("V", "D") else 10
    assert suspects.failures("L", "D") == 6  # at 0, 60, 180, 420, 900, 1860 s
    assert blocked_s == 6 * 60


def test_memory_is_bounded():
    suspects = PushSuspects(max_pairs=3, clock=Clock())
    for i in range(5):
        suspects.rejected(f"U{i}", "D")
    assert [suspects.failures(f"U{i}", "D") for i in range(5)] == [0, 0, 1, 1, 1]


class Float16Server(FakeServer):
    """Announces float16 and refuses a step whose inputs fall outside float16's range, as a server computing in
    float16 does (`codecs.check_castable`; the refusal ends its session with the error)."""

    def server_info(self) -> ServerInfo:
        info = super().server_info()
        info.torch_dtype = "float16"
        return info

    def __init__(self, start: int, end: int, inference_rps: float = 100.0):
        super().__init__(start, end, inference_rps)
        self.refused = 0

    async def _serve(self, requests):
        async def checked():
            async for request in requests:
                if request.tensors:
                    try:
                        check_castable(deserialize_tensor(request.tensors[0]), torch.float16, name="inputs")
                    except ValueError:
                        self.refused += 1
                        raise
                yield request

        async for response in super()._serve(checked()):
            yield response


def test_outputs_past_the_next_servers_dtype_are_routed_around_and_blame_nobody():
    """0:2's outputs of inputs ~1e5 are legal in the float32 client, not in the float16 server of 2:4 (the fastest):
    before, it refused them and was banned for it; now the client does not send them to it and routes around it."""
    torch.manual_seed(0)
    tokens = torch.randn(1, 7, HIDDEN) * 1e5
    narrow = Float16Server(2, 4, inference_rps=1e6)
    servers = {"A": FakeServer(0, 2), "f16": narrow, "B": FakeServer(2, 4)}
    manager = FakeManager(servers, 4, max_wait_s=10)
    outputs = _generate(manager, tokens)
    torch.testing.assert_close(outputs, reference(tokens, 4), rtol=1e-5, atol=0)
    assert not manager.bans.banned_peers()
    assert not narrow.refused  # nothing it would refuse was sent to it
    assert "f16" in manager.avoided_peers()
    small = torch.randn(1, 7, HIDDEN)  # values it holds: it serves them (another client: no avoidance)
    manager = FakeManager(servers, 4, max_wait_s=10)
    torch.testing.assert_close(_generate(manager, small), reference(small, 4), atol=1e-5, rtol=0)
    assert narrow.requests and not manager.bans.banned_peers()


def test_outputs_no_server_of_the_next_span_can_hold_end_the_call_with_nobody_banned():
    torch.manual_seed(0)
    tokens = torch.randn(1, 5, HIDDEN) * 1e5
    servers = {"A": FakeServer(0, 2), "f16": Float16Server(2, 4)}
    manager = FakeManager(servers, 4, max_wait_s=1, max_backoff_s=0.1)
    with pytest.raises(NoHonestServerError, match="finite range of torch.float16"):
        _generate(manager, tokens)
    assert not manager.bans.banned_peers() and not servers["f16"].refused  # before: sent, refused, not banned (sole)


class _NeverEmptied(OrderedDict):
    """A memory's pairs that fail the test where they would be emptied (`may_push` reads emptiness without the lock)."""

    def pop(self, *args):
        if len(self) == 1:
            raise AssertionError("the pairs were emptied")
        return super().pop(*args)

    def __delitem__(self, key):
        if len(self) == 1:
            raise AssertionError("the pairs were emptied")
        super().__delitem__(key)


def test_the_pairs_are_never_emptied_once_one_failed():
    """`may_push` skips the lock while no pair ever failed; so a repeat failure of the only pair must not empty the
    memory for a moment (it popped the pair and set it again: a step on another thread then pushed through the pair
    it was suspending). Also the least recently failed pair goes first past the bound."""
    suspects = PushSuspects(max_pairs=2, clock=lambda: 0.0)
    suspects.rejected("U", "D")
    suspects._pairs = _NeverEmptied(suspects._pairs)
    assert suspects.rejected("U", "D") == 2 * suspects.base_s
    assert suspects.failures("U", "D") == 2 and not suspects.may_push("U", "D")
    suspects.rejected("V", "E")
    suspects.rejected("U", "D")  # now the most recent
    suspects.rejected("W", "F")  # past the bound: V -> E goes
    assert suspects.failures("V", "E") == 0 and suspects.failures("U", "D") == 3


class HugeWriter(Referee):
    """A hostile upstream, announced fastest: writes 1e6 (legal in float32, past float16's range) into one value of
    each of its answers to steps, so that the float16 server after it cannot take them."""

    def __init__(self, start: int, end: int):
        super().__init__(start, end, inference_rps=1e6)
        self.lies = 0

    async def _serve(self, requests):
        async for response in super()._serve(requests):
            outputs = deserialize_tensor(response.tensors[0]).clone()  # [B, T, H]
            outputs[:, -1, 0] = 1e6
            self.lies += 1
            yield runtime_pb2.ExpertResponse(tensors=[serialize_tensor(outputs)])


def _hostile_upstream_swarm(honest_replicas: int) -> tuple[dict[str, FakeServer], FakeManager]:
    servers: dict[str, FakeServer] = {"U": HugeWriter(0, 2)}
    servers.update({f"A{i}": Referee(0, 2) for i in range(honest_replicas)})
    servers.update({"f16": Float16Server(2, 4, inference_rps=1e6), "B": FakeServer(2, 4)})
    return servers, FakeManager(servers, 4, max_wait_s=10)


def test_an_upstream_writing_values_past_float16_is_avoided_not_the_float16_server():
    """Decision 0186. Before, the client routed around the honest float16 server for 60 s (0170) and used the
    upstream's lie through the float32 one: a wrong output. Now a replica of the upstream's span recomputes the step
    and disagrees; with no third to decide, the upstream is avoided (not banned) and the float16 server serves."""
    torch.manual_seed(0)
    tokens = torch.randn(1, 7, HIDDEN)
    servers, manager = _hostile_upstream_swarm(honest_replicas=1)
    outputs = _generate(manager, tokens)
    torch.testing.assert_close(outputs, reference(tokens, 4), atol=1e-5, rtol=0)
    assert servers["U"].lies >= 1 and servers["A0"].forward_calls == 1
    assert "U" in manager.avoided_peers() and "f16" not in manager.avoided_peers()
    assert not manager.bans.banned_peers()  # one replica against one server: nobody is banned
    assert servers["f16"].requests and not servers["f16"].refused


@pytest.mark.parametrize("vouched", [("A0", "A1"), ("A1",), ()], ids=["both_with_standing", "one", "fresh_witnesses"])
def test_an_upstream_writing_values_past_float16_outvoted_by_two_replicas_is_banned_for_good(vouched: tuple[str, ...]):
    """Two replicas outvote the upstream: banned for good where one of them has a witness's standing with this
    client; two fresh ones (which may be one attacker's identities, decision 0190) only get it avoided, and are
    watched. Main banned it either way."""
    torch.manual_seed(0)
    tokens = torch.randn(1, 7, HIDDEN)
    servers, manager = _hostile_upstream_swarm(honest_replicas=2)
    vouch(manager, *vouched)
    outputs = _generate(manager, tokens)
    torch.testing.assert_close(outputs, reference(tokens, 4), atol=1e-5, rtol=0)
    if vouched:
        assert manager.bans.is_liar("U") and manager.bans.banned_peers() == {"U"}
    else:
        assert not manager.bans.banned_peers() and "U" in manager.avoided_peers()
        assert manager.disputes.watched() == {"A0", "A1"}
    assert "f16" not in manager.avoided_peers() and servers["f16"].requests


def test_values_past_float16_that_a_replica_confirms_still_route_around_the_float16_server():
    """The model's own large values (inputs ~1e5, computed truly by both servers of 0:2): a replica agrees, so the
    float16 server is routed around as in 0170 and nobody is blamed."""
    torch.manual_seed(0)
    tokens = torch.randn(1, 7, HIDDEN) * 1e5
    servers = {"A": Referee(0, 2, inference_rps=1e6), "A1": Referee(0, 2), "f16": Float16Server(2, 4, 1e6)}
    servers["B"] = FakeServer(2, 4)
    manager = FakeManager(servers, 4, max_wait_s=10)
    torch.testing.assert_close(_generate(manager, tokens), reference(tokens, 4), rtol=1e-5, atol=0)
    assert not manager.bans.banned_peers() and "A" not in manager.avoided_peers()
    assert "f16" in manager.avoided_peers() and servers["A1"].forward_calls == 1

"""The client side of prefix caching against in-process fake servers with a prefix cache (`helpers.fake_chain`):
the probe and the shortest hit, keys of the blocks each step completes, the same outputs as without a cache after
an eviction or a server leaving mid-conversation (the chain restarts when a span lacks a reused prefix's inputs), no
probe to a stock Petals server, and cache-affine routing."""

from __future__ import annotations

import time

import pytest
import torch

from corolla.client.prefix.prefix_chain import PrefixChain, session_root
from corolla.client.prefix.prefix_routes import PrefixRoutes
from corolla.client.session.inference_session import InferenceSession
from corolla.protocol.prefix import PREFIX_KEY, chain_hashes, prefix_root
from corolla.protocol.records import RemoteSpanInfo, ServerInfo, ServerState
from helpers.fake_chain import HIDDEN, FakeManager, FakeServer, PrefixFakeServer, reference

ROOT = session_root(["m.0"], adapter=None)


def embed(ids: torch.Tensor) -> torch.Tensor:
    """Deterministic toy embeddings of token ids [1, T] -> [1, T, H]."""
    gen = torch.Generator().manual_seed(7)
    table = torch.randn(1000, HIDDEN, generator=gen)
    return table[ids]


def run_turn(manager, ids: torch.Tensor, *, decode: int = 0) -> tuple[torch.Tensor, InferenceSession]:
    """A turn: the prompt (may reuse), then `decode` one-token steps of the following ids; returns the outputs of
    the positions computed (the last ones) and the session."""
    prompt = ids[:, : ids.shape[1] - decode]
    with InferenceSession(manager, max_length=ids.shape[1] + 4, prefix=PrefixChain(ROOT)) as session:
        outs = [session.step(embed(prompt), token_ids=prompt, may_reuse=True)]
        for t in range(prompt.shape[1], ids.shape[1]):
            outs.append(session.step(embed(ids[:, t : t + 1]), token_ids=ids[:, t : t + 1]))
    return torch.cat(outs, dim=1), session


def test_prefix_chain_keys_follow_steps_and_rollbacks():
    chain = PrefixChain(ROOT)
    ids = list(range(40))
    chain.set(0, ids[:20])
    assert chain.hashes == chain_hashes(ROOT, ids[:16])
    chain.set(20, ids[20:40])
    assert chain.hashes == chain_hashes(ROOT, ids[:32])
    assert chain.keys(20, 40) is not None and chain.keys(20, 40).first_block == 1  # block 1 completed here
    assert chain.keys(33, 40) is None  # completes no block
    chain.set(10, [999] * 30)  # a rollback rewrites blocks 0.. from position 10
    assert chain.hashes == chain_hashes(ROOT, ids[:10] + [999] * 22)
    assert prefix_root(model="m.0", adapter="a") != ROOT
    with pytest.raises(ValueError, match="position"):
        chain.set(41, [1])


def test_next_turn_reuses_the_shortest_hit_with_the_same_outputs():
    torch.manual_seed(0)
    servers = {"A": PrefixFakeServer(0, 2), "B": PrefixFakeServer(2, 4)}
    manager = FakeManager(servers, 4)
    ids = torch.randint(0, 1000, (1, 90))
    out1, first = run_turn(manager, ids[:, :50], decode=10)  # prompt 40 + 10 decoded: blocks 0..2 keyed
    assert first.reused_tokens == 0 and servers["A"].hits == [0] and servers["B"].hits == [0]
    torch.testing.assert_close(out1, reference(embed(ids[:, :50]), 4), atol=1e-5, rtol=0)
    # the next turn re-sends the conversation and adds to it
    out2, second = run_turn(manager, ids, decode=5)
    assert second.reused_tokens == 48 and second.prefix_hits == [48, 48]
    full = reference(embed(ids), 4)
    torch.testing.assert_close(out2, full[:, 48:], atol=1e-5, rtol=0)
    first_step = servers["B"].requests[-6]  # the prompt step after the probe: from the hit on
    assert first_step[0]["start_from_position"] == 48 and first_step[1] == 85 - 48
    assert first_step[0][PREFIX_KEY]["first"] == 3  # the blocks it completes: 3, 4 (positions 48..79)
    assert len(first_step[0][PREFIX_KEY]["hashes"]) == 2
    # one server evicted part of it: every span starts at the shortest hit, the other rolls back
    for h in list(servers["B"].store)[2:]:
        del servers["B"].store[h]
    out3, third = run_turn(manager, ids, decode=5)
    assert third.prefix_hits[0] > third.prefix_hits[1] == third.reused_tokens == 32
    torch.testing.assert_close(out3, full[:, 32:], atol=1e-5, rtol=0)
    # evicted everywhere: a full prefill, the same outputs
    servers["A"].store.clear()
    servers["B"].store.clear()
    out4, fourth = run_turn(manager, ids, decode=5)
    assert fourth.reused_tokens == 0
    torch.testing.assert_close(out4, full, atol=1e-5, rtol=0)
    assert servers["A"].open_streams == servers["B"].open_streams == 0


def test_stock_server_in_the_chain_gets_no_probe_and_no_keys():
    torch.manual_seed(1)
    servers = {"A": PrefixFakeServer(0, 2), "B": FakeServer(2, 4)}  # B: a stock Petals server
    manager = FakeManager(servers, 4)
    ids = torch.randint(0, 1000, (1, 40))
    for _ in range(2):
        out, session = run_turn(manager, ids, decode=4)
        assert session.reused_tokens == 0
        torch.testing.assert_close(out, reference(embed(ids), 4), atol=1e-5, rtol=0)
    assert all(PREFIX_KEY not in m for m, _ in servers["B"].requests)
    assert all(tokens > 0 for _, tokens in servers["B"].requests)  # never a zero-token probe
    assert any(PREFIX_KEY in m for m, _ in servers["A"].requests)  # the corolla server still keys its blocks
    assert servers["A"].hits == []  # but nobody asks it for a hit the chain could not use


def test_beam_sessions_reuse_nothing_and_send_no_keys():
    """Keys name one sequence: a session of several rows (beams) after a cached conversation makes no probe, sends
    no keys and computes every position, with the reference's outputs; a one-row session that reorders its cache
    (hypo_ids) keys nothing from then on. (`generate()` refuses num_beams > 1; the engine's side: test_engine_prefix.)"""
    torch.manual_seed(5)
    servers = {"A": PrefixFakeServer(0, 2), "B": PrefixFakeServer(2, 4)}
    manager = FakeManager(servers, 4)
    ids = torch.randint(0, 1000, (1, 60))
    run_turn(manager, ids[:, :48])  # blocks 0..2 cached on both servers
    assert len(servers["B"].store) == 3
    sent = len(servers["B"].requests)
    beams = ids[:, :56].expand(2, -1)  # the conversation again, as 2 beams
    with InferenceSession(manager, max_length=60, prefix=PrefixChain(ROOT)) as session:
        out = session.step(embed(beams), token_ids=beams, may_reuse=True)
        assert session.reused_tokens == 0 and session.prefix_hits == [] and session.prefix is not None
        assert not session.prefix.active
    torch.testing.assert_close(out, reference(embed(beams), 4), atol=1e-5, rtol=0)
    later = servers["B"].requests[sent:]
    assert later and all(n > 0 and PREFIX_KEY not in m for m, n in later)  # no zero-token probe, no keys
    sent = len(servers["B"].requests)
    with InferenceSession(manager, max_length=60, prefix=PrefixChain(ROOT)) as session:
        session.step(embed(ids[:, :20]), token_ids=ids[:, :20])  # keys block 0
        session.step(embed(ids[:, 20:40]), hypo_ids=torch.zeros(1, dtype=torch.int64), token_ids=ids[:, 20:40])
        assert session.prefix is not None and not session.prefix.active
    keyed = [m[PREFIX_KEY]["first"] for m, _ in servers["B"].requests[sent:] if PREFIX_KEY in m]
    assert keyed == [0]  # the reordered step named no block


def test_server_leaving_after_a_hit_restarts_the_chain_with_the_same_outputs():
    """B held the prefix; B dies mid-answer; its replacement C never had the inputs of the reused positions, and
    neither has the client: the chain restarts from position 0 (A recomputes), and the tokens are the same."""
    torch.manual_seed(2)
    servers = {"A": PrefixFakeServer(0, 2), "B": PrefixFakeServer(2, 4, inference_rps=1000.0)}
    manager = FakeManager(servers, 4)
    ids = torch.randint(0, 1000, (1, 80))
    run_turn(manager, ids[:, :40], decode=4)
    servers["C"] = PrefixFakeServer(2, 4)
    manager.update()
    prompt = ids[:, :70]
    with InferenceSession(manager, max_length=84, prefix=PrefixChain(ROOT)) as session:
        outs = [session.step(embed(prompt), token_ids=prompt, may_reuse=True)]
        assert session.reused_tokens == 32 and session.route[1][0].peer_id == "B"
        for t in range(70, 80):
            if t == 74:
                servers["B"].dead = True
            outs.append(session.step(embed(ids[:, t : t + 1]), token_ids=ids[:, t : t + 1]))
        assert session.num_restarts == 1 and session.route[1][0].peer_id == "C"
    torch.testing.assert_close(torch.cat(outs, dim=1), reference(embed(ids), 4)[:, 32:], atol=1e-5, rtol=0)
    restart = [m for m, n in servers["A"].requests if m.get("start_from_position") == 0 and n > 0]
    assert len(restart) >= 1  # A recomputed from position 0 to give C its inputs
    assert servers["C"].final_lengths == [80]


def test_first_span_failing_after_a_hit_replays_the_embeddings():
    torch.manual_seed(3)
    servers = {"A": PrefixFakeServer(0, 2, inference_rps=1000.0), "B": PrefixFakeServer(2, 4)}
    manager = FakeManager(servers, 4)
    ids = torch.randint(0, 1000, (1, 60))
    run_turn(manager, ids[:, :40], decode=4)
    servers["A2"] = PrefixFakeServer(0, 2)
    manager.update()
    with InferenceSession(manager, max_length=64, prefix=PrefixChain(ROOT)) as session:
        outs = [session.step(embed(ids[:, :50]), token_ids=ids[:, :50], may_reuse=True)]
        assert session.reused_tokens == 32
        servers["A"].dead = True
        for t in range(50, 60):
            outs.append(session.step(embed(ids[:, t : t + 1]), token_ids=ids[:, t : t + 1]))
        assert session.num_restarts == 0  # the first span holds its inputs: a plain replay
    torch.testing.assert_close(torch.cat(outs, dim=1), reference(embed(ids), 4)[:, 32:], atol=1e-5, rtol=0)
    assert servers["A2"].requests[0][0]["start_from_position"] == 0


def _span(peer: str, start: int, end: int, *, rps: float | None = 100.0, busy: float | None = None) -> RemoteSpanInfo:
    info = ServerInfo(ServerState.ONLINE, 1.0, start_block=start, end_block=end, inference_rps=rps, busy_fraction=busy)
    return RemoteSpanInfo(peer, start, end, info)


def test_cache_affine_routing_prefers_the_chain_that_held_the_prefix():
    routes = PrefixRoutes()
    chain = PrefixChain(ROOT)
    chain.set(0, list(range(200)))
    view = [_span("A", 0, 2), _span("B", 2, 4), _span("C", 0, 4)]
    assert routes.route_for(view, chain, 0, 4, new_tokens=50) is None  # nothing remembered
    routes.remember(chain, [view[0], view[1]], 150)
    route = routes.route_for(view, chain, 0, 4, new_tokens=50)
    assert route is not None and [s.peer_id for s in route] == ["A", "B"]
    longer = PrefixChain(ROOT)  # the next turn: the old conversation and more
    longer.set(0, list(range(200)) + [5] * 40)
    assert routes.lookup(longer)[1] == 144
    other = PrefixChain(ROOT)
    other.set(0, [9] * 200)
    assert routes.route_for(view, other, 0, 4, new_tokens=50) is None  # another conversation
    assert routes.route_for([view[0], view[2]], chain, 0, 4, new_tokens=50) is None  # B left
    busy = [view[0], _span("B", 2, 4, busy=0.95), view[2]]
    assert routes.route_for(busy, chain, 0, 4, new_tokens=50) is None  # B overloaded
    fast = [view[0], view[1], _span("C", 0, 4, rps=10000.0)]  # a much faster chain wins over a long answer
    assert routes.route_for(fast, chain, 0, 4, new_tokens=2000) is None
    assert routes.route_for(fast, chain, 0, 4, new_tokens=1) is not None  # ...not over a short one
    # a newcomer that announces no speed yet (it has served no step) is no evidence against the measured chain: at the
    # default figure it looked faster than a measured server on a busy host and took the session from its cache
    unmeasured = [view[0], view[1], _span("C", 0, 4, rps=None)]
    assert routes.route_for(unmeasured, chain, 0, 4, new_tokens=2000) is not None


def test_session_routes_to_the_chain_that_held_its_prefix():
    torch.manual_seed(4)
    servers = {"AB": PrefixFakeServer(0, 4), "CD": PrefixFakeServer(0, 4)}
    manager = FakeManager(servers, 4)
    ids = torch.randint(0, 1000, (1, 60))
    run_turn(manager, ids[:, :40], decode=4)
    for turn in range(3):
        out, session = run_turn(manager, ids, decode=4)
        assert session.reused_tokens == 32 + 16 * min(turn, 1)  # the second repeat also reuses block 2 (44..59)
        torch.testing.assert_close(out, reference(embed(ids), 4)[:, session.reused_tokens :], atol=1e-5, rtol=0)
    assert sorted(len(s.hits) for s in servers.values()) == [0, 4]  # every turn on the chain that held the prefix
    assert manager.prefix_routes.num_affine == 3
    load = manager.routed.load(time.monotonic())
    assert len(load) == 1 and max(load.values()) > 3.9  # the affine sessions count as load, as the planned one did
    # the server holding the prefix was then seen crawling (decision 0189: 1 s a block against its 100 announced): the
    # next turn is priced by what it delivered, as new routes are, and leaves it for the other chain's prefill
    held = next(name for name, server in servers.items() if server.hits)
    manager.observed_steps.note(held, 1.0, time.monotonic())
    out, session = run_turn(manager, ids, decode=4)
    assert session.reused_tokens == 0 and [span.peer_id for span, _ in session.route] != [held]
    torch.testing.assert_close(out, reference(embed(ids), 4), atol=1e-5, rtol=0)


@pytest.mark.parametrize("tuning_mode", [None, "ptune", "deep_ptune"])
def test_generate_reuses_a_prefix_with_tuned_prompts_in_the_root(tuning_mode):
    """generate() through a distributed model: the next turn reuses its prefix (tuned prefix positions included)
    with the tokens of a run without the cache; prompts that changed (a training step) share nothing."""
    from transformers import LlamaConfig

    from corolla.client.models.distributed_model import LAYOUTS, DistributedModelForCausalLM
    from corolla.client.training.prompt_tuning import TuningConfig

    config = LlamaConfig(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=16, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, pad_token_id=0, rms_norm_eps=1e-5,
    )  # fmt: skip
    manager = FakeManager({"A": PrefixFakeServer(0, 2), "B": PrefixFakeServer(2, 4)}, 4)
    torch.manual_seed(0)
    tuning = TuningConfig(tuning_mode, 3 if tuning_mode else 0)
    model = DistributedModelForCausalLM(config, LAYOUTS["llama"], manager, tuning)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)

    def generate(ids: torch.Tensor) -> tuple[list[int], int]:
        with model.inference_session(max_length=ids.shape[1] + 6) as session:
            out = model.generate(ids, max_new_tokens=6, do_sample=False, session=session)
            return out[0].tolist(), session.reused_tokens

    first = torch.randint(1, 64, (1, 30))
    out1, reused1 = generate(first)
    assert reused1 == 0
    second = torch.tensor([out1 + torch.randint(1, 64, (10,)).tolist()])
    out2, reused2 = generate(second)
    assert reused2 == 32  # 3 tuned positions (if any) + 35 known tokens: whole blocks below the last position
    model.manager.config.prefix_reuse = False
    assert generate(second) == (out2, 0)
    model.manager.config.prefix_reuse = True
    if tuning_mode is not None:
        with torch.no_grad():
            model.prompt_tuning.prompt_embeddings.weight.add_(0.1)  # the prompts moved: another root
        assert generate(second)[1] == 0

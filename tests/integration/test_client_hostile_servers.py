"""Clients against a real lying server process (`tests.helpers.hostile_server`): one server of blocks 0:2 that
announces itself as the fastest (so routes go through it) lies as a file tells it to; two honest replicas of 0:2 and
two honest servers of 2:4 (in this process). NaN, wrong shapes and hangs fail over to an honest replica with greedy output identical to
local `transformers` and only the liar banned; finite garbage is caught by verification (the liar as the span's
server or as a referee; in the background, by a shadow session on a replica, whose finding another client re-checks
first-hand with `corolla-findings` and bans the liar on, while the same finding forged against an honest replica
bans nobody); an upstream that pushes other outputs than it answers gets no honest server banned (garbage: by a
verifying client, which forwards nothing; one token more: by any client); a lone liar or missing blocks end in NoHonestServerError (corolla-generate: one line, exit 1) within
max_wait_s."""

from __future__ import annotations

import math
import time

import pytest
import torch
from tests.helpers.hostile_server import start_hostile_server
from tests.helpers.swarm import bootstrapped, inprocess_servers
from tests.helpers.tiny_models import hf_greedy, make_tiny_model

from corolla.cli.findings import main as findings_main
from corolla.cli.generate import main as generate_main
from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
from corolla.client.routing.findings import Finding, decode_finding, encode_finding
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.utils.errors import NoHonestServerError

pytestmark = pytest.mark.timeout(300)

PROMPT = torch.tensor([[1, 8, 27, 64, 125]])
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("models"), seed=5)


@pytest.fixture(scope="module")
def mode_file(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("hostile") / "mode"
    path.write_text("honest")
    return path


# Records live this long (seconds): no server of this module stops, and with the default (2 x the 2 s update period)
# a starved announcer let the liar's record lapse between two refreshes (the lone-liar test then saw no server of
# 0:2: MissingBlocksError instead of NoHonestServerError).
RECORD_TTL_S = 60.0


@pytest.fixture(scope="module")
def swarm(model_path, mode_file, tmp_path_factory: pytest.TempPathFactory):
    """The liar is a process (its handler is patched); the honest servers run in this process (what they answer is
    under test, not their process: four interpreter start-ups less)."""
    with bootstrapped(tmp_path_factory.mktemp("swarm")) as swarm:
        liar = start_hostile_server(
            swarm, model_path, "honest", "--block_indices", "0:2", "--expiration", str(RECORD_TTL_S),
            attract=True, mode_file=mode_file, wait=False,
        )  # fmt: skip
        # 2:4 twice: a verifying client never trusts a lone server
        spans = [(model_path, blocks) for blocks in ("0:2", "0:2", "2:4", "2:4")]
        cache_dir = tmp_path_factory.mktemp("cache")
        with inprocess_servers(
            spans, cache_dir, swarm.initial_peers, update_period_s=2.0, expiration_s=RECORD_TTL_S
        ) as honest:
            liar.wait_ready(150)
            swarm.liar, swarm.honest = liar, honest
            yield swarm


@pytest.fixture(scope="module")
def expected(model_path):
    return hf_greedy(model_path, PROMPT, NEW_TOKENS)


def _config(**overrides) -> ClientConfig:
    settings = dict(
        update_period_s=2.0, min_backoff_s=0.2, max_backoff_s=1.0, liveness_check_period_s=1.0, max_wait_s=20.0,
        max_pinged=0,  # no RTTs (a ping lost on a busy machine would steer the route): the announced speeds decide
        # a test swarm of known servers: any two that agree are witnesses (main's 2:1 rule; a fresh client's rule
        # for strangers, decision 0190, is tested with fakes: tests/unit/test_client_distrust.py, slow_servers)
        witness_standing_steps=0,
    )  # fmt: skip
    settings.update(overrides)
    return ClientConfig(**settings)


def _push_failures(session, swarm) -> int:
    """Answers to the liar's pushes into the honest servers that failed the client's checks (`push_suspects`)."""
    suspects = session.manager.push_suspects
    return sum(suspects.failures(swarm.liar.peer_id, server.peer_id) for server in swarm.honest)


def _generate(swarm, model_path, config: ClientConfig, **tuning):
    """Greedy generation through the swarm; with `tuning` (e.g. tuning_mode="deep_ptune"), random tuned prompts."""
    with AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=swarm.initial_peers, client_config=config, **tuning
    ) as model:
        if model.prompt_tuning is not None:
            generator = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for weight in model.prompt_tuning.parameters():
                    weight.copy_(0.3 * torch.randn(weight.shape, generator=generator))
        model.manager.wait_ready()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # every server announced, with the pings it measured to the next one
            spans = model.manager.spans
            downstream = {span.peer_id for span in spans if span.start == 2}
            pinged = [
                {peer for peer, rtt in (span.server_info.next_pings or {}).items() if math.isfinite(rtt)}
                for span in spans
                if span.start == 0
            ]
            servers = 1 + len(swarm.honest) - len(config.blocked_servers or ())
            if len(spans) == servers and downstream and all(downstream <= peers for peers in pinged):
                break
            time.sleep(0.2)
            model.manager.update()
        first_hop = model.manager.make_sequence(mode="min_latency")[0].peer_id
        with model.inference_session(max_length=PROMPT.shape[1] + NEW_TOKENS) as session:
            output = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, session=session)
        return output, model.manager.bans.banned_peers(), first_hop, session


@pytest.mark.parametrize(
    "lie, transport",
    [("nan 3", True), ("nan 3", False), ("shape 3", False), ("dtype 0", False), ("hang 3", True)],
    ids=["nan-socket", "nan-p2p", "shape", "dtype", "hang"],
)
def test_bad_outputs_fail_over_and_ban_only_the_liar(swarm, model_path, mode_file, expected, lie, transport):
    mode_file.write_text(lie)
    config = _config(local_transport=transport, request_timeout_s=3.0)
    output, banned, first_hop, _ = _generate(swarm, model_path, config)
    assert first_hop == swarm.liar.peer_id  # the route went through the liar first
    assert output.tolist() == expected.tolist()
    assert swarm.liar.peer_id in banned
    assert not banned & {server.peer_id for server in swarm.honest}  # never the honest downstream server


def test_finite_garbage_is_caught_by_verification(swarm, model_path, mode_file, expected):
    mode_file.write_text("garbage 3")
    output, banned, first_hop, session = _generate(swarm, model_path, _config(verify_fraction=1.0))
    assert output.tolist() == expected.tolist()
    assert swarm.liar.peer_id in banned and not banned & {server.peer_id for server in swarm.honest}
    if first_hop == swarm.liar.peer_id:  # the liar served the span: its outputs were rejected by two referees
        assert session.verifier.num_rejected >= 1
    else:  # on a loaded machine the route may start at an honest replica: the liar, asked as a referee, is outvoted
        assert session.verifier.num_verified >= 1


def test_an_upstream_pushing_other_outputs_gets_no_honest_server_banned(swarm, model_path, mode_file, expected):
    """The liar answers the client truly and pushes garbage to the next server (equivocation), its reply held until
    the push is in: the next server answered the pushed copy, and the client's check of that reply against its own
    copy of the inputs banned the honest servers of 2:4 one after the other (NoHonestServerError). A client that
    verifies names no next server (decision 0153), so no push reaches its sessions."""
    mode_file.write_text("equivocate 0")
    output, banned, first_hop, _ = _generate(swarm, model_path, _config(verify_fraction=1.0))
    assert first_hop == swarm.liar.peer_id  # the route went through the liar first
    assert output.tolist() == expected.tolist()
    assert not banned & {server.peer_id for server in swarm.honest}


def test_an_upstream_pushing_more_tokens_gets_no_honest_server_banned(swarm, model_path, mode_file, expected):
    """The liar answers the client truly and pushes its outputs with one token more (the push rules allow up to the
    client's biggest step: its prefill), its reply held until the push is in: the next server answers the pushed
    copy, its outputs one token longer than the client's own copy asked for, and the client banned the honest
    servers of 2:4 one after the other for it (the liar never). Now such a reply blames nobody: the span is replayed
    and the pair is not pushed through for a while (decisions 0154, 0169). Over p2p: a chain of same-host sockets is not forwarded."""
    mode_file.write_text("overpush 0")
    output, banned, first_hop, session = _generate(swarm, model_path, _config(local_transport=False))
    assert first_hop == swarm.liar.peer_id  # the route went through the liar first
    assert output.tolist() == expected.tolist()
    assert not banned & {server.peer_id for server in swarm.honest}
    assert _push_failures(session, swarm) >= 1  # a pushed reply was rejected (the liar's push reached 2:4)


def test_an_upstream_pushing_an_earlier_start_gets_no_honest_server_banned(swarm, model_path, mode_file, expected):
    """The liar pushes its true outputs from position 1 (the push rules allow a start from just past the client's
    last step's first token: after the prefill, 1): the next server rolls its cache back to 2 positions and answers
    with the right shape, and the client's next step (from 6) was refused by it, then by the other honest server of
    2:4 the same way, both banned. Now the reply says where the pushed step started (`corolla.pushed_from`), and one
    that is not the client's own start blames nobody (decision 0154)."""
    mode_file.write_text("rewind 0")
    output, banned, first_hop, session = _generate(swarm, model_path, _config(local_transport=False))
    assert first_hop == swarm.liar.peer_id  # the route went through the liar first
    assert not banned & {server.peer_id for server in swarm.honest}
    assert output.tolist() == expected.tolist()
    assert _push_failures(session, swarm) >= 1  # a pushed reply was rejected (the liar's push reached 2:4)


def test_finite_garbage_is_caught_by_a_shadow_session(swarm, model_path, mode_file):
    """A deep-prompt-tuned session (its prompts go with position 0, to the shadows too: they were dropped before)."""
    mode_file.write_text("garbage 3")
    config = _config(verify_shadow_fraction=1.0)
    _, banned, first_hop, session = _generate(swarm, model_path, config, tuning_mode="deep_ptune", pre_seq_len=2)
    assert not banned & {server.peer_id for server in swarm.honest}  # two honest replicas never outvote each other
    if first_hop == swarm.liar.peer_id:  # the liar served 0:2: its shadow disagreed, a third replica decided
        assert swarm.liar.peer_id in banned and session.shadows.findings
        assert session.shadows.findings[0].peer_id == swarm.liar.peer_id
    assert session.shadows.num_positions_verified >= 1
    # the shadows were sessions of real corolla servers (marked, at their low priority), and agreed where honest
    assert any(shadow.state in ("agreed", "caught") for shadow in session.shadows.shadows)
    assert not any(shadow.state == "dropped" for shadow in session.shadows.shadows)


def test_a_shared_finding_bans_the_liar_first_hand_and_a_forged_one_bans_nobody(
    swarm, model_path, mode_file, tmp_path, capsys
):
    """Client A (`corolla-generate --verify_shadow_fraction 1 --findings_dir A`) catches the liar by a shadow session
    and keeps its finding in A; client B re-checks that file against the live swarm (`corolla-findings`) and bans
    the liar (in B's directory, banned again by B's next client); the same finding with an honest replica named as
    the accused (what a liar would send to frame it) comes out "unverifiable" and bans nobody."""
    mode_file.write_text("garbage 0")
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    liar = swarm.liar.peer_id
    caught = a_dir / f"{liar}.finding"
    for _ in range(3):  # caught as the span's server or as its shadow; on a loaded machine maybe neither: ask again
        code = generate_main(
            [str(model_path), "hello", "--initial_peers", *swarm.initial_peers, "--max_new_tokens", "4",
             "--verify_shadow_fraction", "1", "--findings_dir", str(a_dir), "--max_wait_s", "20",
             "--witness_standing_steps", "0"]
        )  # fmt: skip
        out = capsys.readouterr().out
        assert code == 0, out
        if caught.is_file():
            break
    assert f"caught lying: {liar} (findings in {a_dir})" in out, out
    assert caught.is_file() and (a_dir / "liars").read_text().split() == [liar]
    honest = swarm.honest[0].peer_id  # a replica of 0:2
    forged = tmp_path / "forged.finding"
    finding = decode_finding(caught.read_bytes())
    forged.write_bytes(encode_finding(Finding(honest, finding.blocks, finding.inputs, finding.claimed, finding.first)))
    started = time.monotonic()
    code = findings_main(
        [str(model_path), str(caught), str(forged), "--initial_peers", *swarm.initial_peers,
         "--findings_dir", str(b_dir), "--timeout_s", "120", "--witness_standing_steps", "0"]
    )  # fmt: skip
    assert code == 0 and time.monotonic() - started < 150
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith(f"{caught}: caught (accused {liar}"), lines
    assert lines[-1].startswith(f"{forged}: unverifiable (accused {honest}"), lines  # the liar, banned, not asked
    assert (b_dir / "liars").read_text().split() == [liar]  # the honest replica is not there
    assert {entry.name for entry in b_dir.glob("*.finding")} == {f"{liar}.finding"}  # B's own first-hand finding
    b_next = RemoteSequenceManager(ClientConfig(findings_dir=str(b_dir)), ["x.0"], start_updates=False)
    assert b_next.bans.banned_peers() == {liar}


def test_lone_liar_ends_in_a_clear_error_within_max_wait(swarm, model_path, mode_file):
    mode_file.write_text("nan 0")
    others = [server.peer_id for server in swarm.honest[:2]]  # the liar is the only server of 0:2 for this client
    config = _config(blocked_servers=others, max_wait_s=4.0)
    started = time.monotonic()
    with pytest.raises(NoHonestServerError) as info:
        _generate(swarm, model_path, config)
    elapsed_s = time.monotonic() - started
    assert elapsed_s < 60, elapsed_s
    assert "blocks 0:2" in str(info.value) and swarm.liar.peer_id[-6:] in str(info.value)


def test_corolla_generate_prints_one_line_and_exits_nonzero(swarm, model_path, capsys):
    from corolla.cli.generate import main

    started = time.monotonic()
    code = main(
        [str(model_path), "hello", "--initial_peers", *swarm.initial_peers, "--dht_prefix", "nobody-serves-this",
         "--max_wait_s", "3", "--max_new_tokens", "2"]
    )  # fmt: skip
    elapsed_s = time.monotonic() - started
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and elapsed_s < 60
    assert err[-1].startswith("corolla-generate: error: no honest server for blocks 0:4")
    assert not any("Traceback" in line for line in err)

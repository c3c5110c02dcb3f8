"""Server processes in a loopback swarm: `--throughput dry_run` measures and exits (a later start reuses the cached
figures); automatic block selection (corolla's policy) covers the model; a `--block_indices` server stays put; a
pinned server joining on a movable one's blocks, leaving the rest uncovered, makes the movable one move there at its
next balance check (no dwelling while a block has no server), in its log and metrics; records go JOINING -> ONLINE ->
OFFLINE; SIGTERM (OFFLINE first) and SIGKILL leave no process behind."""

from __future__ import annotations

import json
import signal
import time
import urllib.request

import pytest

from corolla.cli.run_server import main as run_server_main
from corolla.protocol.records import ServerState
from corolla.swarm.dht import SwarmConfig, create_dht, shutdown_dht
from corolla.swarm.records_io import get_remote_module_infos
from helpers.swarm import SHORT_UPDATE_PERIOD, Swarm, swarm  # noqa: F401  (fixture)
from helpers.tiny_models import make_tiny_model

NUM_LAYERS = 4
pytestmark = pytest.mark.timeout(240)


def read_states(dht, prefix: str) -> dict[str, dict[int, ServerState]]:
    """`{peer_id: {block: state}}` from the DHT."""
    infos = get_remote_module_infos(dht, [f"{prefix}.{i}" for i in range(NUM_LAYERS)], latest=True, timeout_s=10)
    states: dict[str, dict[int, ServerState]] = {}
    for index, info in enumerate(infos):
        for peer, server_info in info.servers.items():
            states.setdefault(peer, {})[index] = server_info.state
    return states


def wait_for(predicate, timeout_s: float, interval_s: float = 0.3):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


def test_dry_run_then_swarm_lifecycle(swarm: Swarm, tmp_path, capsys):  # noqa: F811
    model = make_tiny_model("llama", tmp_path / "models", num_layers=NUM_LAYERS)
    prefix = model.name  # local directories use their name as the DHT prefix
    cache_dir = swarm.workdir / "cache"

    # --throughput dry_run: prints the figures, writes the cache, exits 0 (the CLI's main, in this process)
    code = run_server_main(
        [str(model), "--new_swarm", "--device", "cpu", "--torch_dtype", "float32", "--num_blocks", "2",
         "--throughput", "dry_run", "--cache_dir", str(cache_dir)]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0
    assert "corolla-server: throughput" in printed and "forward_rps=" in printed and "inference_rps=" in printed
    cached = json.loads((cache_dir / "throughput_v1.json").read_text())
    assert len(cached) == 1 and all(v > 0 for v in next(iter(cached.values())).values())

    swarm.start_bootstrap()
    reader = create_dht(SwarmConfig(initial_peers=swarm.initial_peers, client_mode=True))
    try:
        # A: movable, alone -> takes 0:2; B then pins 0:2 -> A should move to 2:4 (blocks 2-3 uncovered)
        balance = ("--throughput", "1", "--mean_balance_check_period", "1")
        a = swarm.start_server(model, "--num_blocks", "2", "--metrics_port", "0", *balance)
        assert (a.start_block, a.end_block) == (0, 2)
        assert any("server.placed(policy=corolla, blocks=0:2)" in line for line in a.lines)
        # B's heartbeat pings the servers after its blocks: A is there only once it moved (after B's first records),
        # and B announces the RTT to it at its next heartbeat (checked below, within 15 s)
        b = swarm.start_server(model, "--block_indices", "0:2", *balance, *SHORT_UPDATE_PERIOD)
        assert (b.start_block, b.end_block) == (0, 2)
        a.wait_ready(90, start=a.lines.index(a.ready_lines()[0]) + 1)
        assert (a.start_block, a.end_block) == (2, 4), a.tail()
        assert any("server.balance_check(policy=corolla, move=True" in line for line in a.lines)
        url = next(line.split("metrics at ")[1].strip() for line in a.lines if "corolla-server: metrics at " in line)
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        assert "corolla_moves_total 1.0" in text and "corolla_span_loads_total 2.0" in text

        # C: automatic selection with auto throughput, reusing the cached figures
        c = swarm.start_server(model, "--num_blocks", "2", "--throughput", "auto")
        assert "throughput.cached" in c.output and "throughput.measured" not in c.output
        for server in (a, b, c):  # JOINING is announced before loading, ONLINE only after the handlers are up
            server.wait_for_line(lambda s: "announcer.declared(state=ONLINE" in s, 10)
            joining = next(i for i, s in enumerate(server.lines) if "announcer.declared(state=JOINING" in s)
            loaded = next(i for i, s in enumerate(server.lines) if "runtime.start" in s)
            online = next(i for i, s in enumerate(server.lines) if "announcer.declared(state=ONLINE" in s)
            assert joining < online and loaded < online

        def all_online():
            states = read_states(reader, prefix)
            online = {p: s for p, s in states.items() if set(s.values()) == {ServerState.ONLINE}}
            return states if {a.peer_id, b.peer_id, c.peer_id} <= set(online) else None

        states = wait_for(all_online, 30)
        assert states, read_states(reader, prefix)
        covered = set().union(*(set(states[p]) for p in (a.peer_id, b.peer_id, c.peer_id)))
        assert covered == set(range(NUM_LAYERS))
        assert set(states[b.peer_id]) == {0, 1} and len(b.ready_lines()) == 1  # the fixed server stayed put

        # B (0:2) pings the servers of the blocks after its first one, including A (2:4), and announces the RTTs
        def b_pings():
            info = get_remote_module_infos(reader, [f"{prefix}.0"], latest=True, timeout_s=10)[0].servers.get(b.peer_id)
            return info is not None and info.next_pings and a.peer_id in info.next_pings and info

        info = wait_for(b_pings, 15)
        assert info, "B never announced a ping to A"
        assert 0 <= info.next_pings[a.peer_id] < 5 and info.cache_tokens_left > 0
        assert (info.start_block, info.end_block, info.torch_dtype, info.quant_type) == (0, 2, "float32", "none")

        # SIGTERM: OFFLINE is announced, then the whole process group exits
        c.signal(signal.SIGTERM)
        assert c.wait(30) == 0
        assert c.wait_group_gone(10)
        assert any("announcer.declared(state=OFFLINE" in s for s in c.lines)
        offline = wait_for(
            lambda: set(read_states(reader, prefix).get(c.peer_id, {}).values()) <= {ServerState.OFFLINE}, 10
        )
        assert offline, read_states(reader, prefix)

        # SIGKILL: no cleanup code runs, yet nothing of the server survives (DHT process and p2pd die with it)
        a.signal(signal.SIGKILL)
        a.wait(10)
        assert a.wait_group_gone(10), "a SIGKILLed server left processes behind"
        assert b.group_alive()
    finally:
        shutdown_dht(reader)

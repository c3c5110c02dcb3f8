"""A server behind a WAN proxy (benchmarks.wan_emulator) with a 30 ms one-way delay, announcing the proxy's address: the address
it gives peers is the proxy's only, a client's inference step takes at least one round trip (2 x 30 ms), and every TCP
connection the server accepted (client, DHT) came through the proxy. One in-process server, one client."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from tests.helpers.ports import free_port
from tests.helpers.swarm import start_inprocess_server
from tests.helpers.tiny_models import make_tiny_model

from benchmarks.wan_emulator import LinkConfig, ProxyThread
from corolla.client import AutoDistributedModelForCausalLM, ClientConfig

pytestmark = pytest.mark.timeout(120)

DELAY_MS = 30.0


def _established_peers_of(port: int) -> list[int]:
    """Remote ports of the established IPv4 TCP connections whose local port is `port` (from /proc/net/tcp)."""
    remotes = []
    with open("/proc/net/tcp", encoding="ascii") as f:
        next(f)
        for line in f:
            fields = line.split()
            local, remote, state = fields[1], fields[2], fields[3]
            if state == "01" and int(local.split(":")[1], 16) == port:
                remotes.append(int(remote.split(":")[1], 16))
    return remotes


def test_every_connection_to_a_server_crosses_its_proxy(tmp_path: Path) -> None:
    model_path = make_tiny_model("llama", tmp_path / "models")
    server_port = free_port()
    with ProxyThread() as wan:
        proxy = wan.add(server_port, LinkConfig(delay_ms=DELAY_MS))
        server = start_inprocess_server(
            model_path,
            tmp_path / "cache",
            host_maddrs=(f"/ip4/127.0.0.1/tcp/{server_port}",),
            announce_maddrs=(f"/ip4/127.0.0.1/tcp/{proxy.port}",),
            local_socket=False,
            throughput=1.0,
            block_indices=(0, 4),
        )
        try:
            assert server.join_maddrs, "the server gives no address to join"
            for maddr in server.join_maddrs:  # peers learn the proxy's address, never the server's own
                assert f"/tcp/{proxy.port}/" in maddr and f"/tcp/{server_port}/" not in maddr, maddr
            config = ClientConfig(max_retries=2, update_period_s=30.0, local_transport=False)
            with AutoDistributedModelForCausalLM.from_pretrained(
                model_path, initial_peers=list(server.join_maddrs), client_config=config
            ) as model:
                prompt = torch.tensor([[1, 17, 42, 99]])
                with torch.no_grad(), model.inference_session(max_length=16):
                    model(prompt)
                    steps_s = []
                    for token in (5, 6, 7):
                        start = time.perf_counter()
                        model(torch.tensor([[token]]))
                        steps_s.append(time.perf_counter() - start)
                assert min(steps_s) >= 2 * DELAY_MS / 1000, steps_s  # the step crossed the proxy both ways
                assert proxy.stats.connections >= 1 and proxy.stats.bytes_to_target > 0
                accepted = _established_peers_of(server_port)
                upstream = proxy.upstream_ports()
                assert accepted, "no connection to the server at all"
                assert set(accepted) <= upstream, (accepted, upstream)  # none bypassed the proxy
        finally:
            server.shutdown()

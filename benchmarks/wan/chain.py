"""Chains of servers behind WAN proxies for `python -m benchmarks.wan`: a bootstrap node (not proxied), then n servers,
each on a fixed loopback port with a `WanProxy` in front and announcing only the proxy's address, so every
connection to a server (client, other servers, DHT) crosses its proxy and a link costs one proxy's delay.
`CorollaChain` starts corolla servers (`--no_local_socket`: a same-host client must not take the unix socket around
the proxy); `PetalsChain` starts stock Petals 2.2 servers from the Petals venv (`petals_side.py server`).
`check_all_through_proxies` verifies from /proc/net/tcp that no established connection reached a server directly."""

from __future__ import annotations

import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from benchmarks.wan_emulator import LinkConfig, ProxyThread, WanProxy
from corolla.swarm.local import LocalSwarm, LocalSwarmConfig, even_block_ranges
from corolla.utils.logging import get_logger
from corolla.utils.processes import ChildProcess

logger = get_logger(__name__)

PETALS_DRIVER = Path(__file__).with_name("petals_side.py")
PETALS_READY = "petals-wan: ready"


class ChainError(RuntimeError):
    """A chain could not be started or a check of it failed."""


def free_port() -> int:
    """A loopback port free right now (the server binds it moments later; a race with another binder is possible
    and shows up as a server that does not start, which the bench reports)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def established_remote_ports(port: int) -> list[int]:
    """Remote ports of established IPv4 TCP connections whose local port is `port` (from /proc/net/tcp)."""
    remotes = []
    with open("/proc/net/tcp", encoding="ascii") as f:
        next(f)
        for line in f:
            fields = line.split()
            if fields[3] == "01" and int(fields[1].split(":")[1], 16) == port:
                remotes.append(int(fields[2].split(":")[1], 16))
    return remotes


_ChainT = TypeVar("_ChainT", bound="_Chain")


class _Chain:
    """What both kinds share: the proxies (one per server) and the server ports behind them."""

    swarm: LocalSwarm  # set by each kind's constructor

    @property
    def initial_peers(self) -> list[str]:
        return self.swarm.initial_peers

    def check(self) -> dict[str, int]:
        return self.check_all_through_proxies(self._port_of(self.swarm.initial_peers[0]))

    def close(self) -> None:
        self.swarm.close()

    def __enter__(self: _ChainT) -> _ChainT:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __init__(self, wan: ProxyThread, workdir: Path, num_servers: int, num_blocks: int):
        self.wan = wan
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.ranges = even_block_ranges(num_blocks, num_servers)
        if len(self.ranges) != num_servers:
            raise ChainError(f"{num_blocks} blocks can't be split over {num_servers} servers")
        self.server_ports: list[int] = []
        self.proxies: list[WanProxy] = []

    def _add_proxy(self) -> tuple[int, WanProxy]:
        port = free_port()
        proxy = self.wan.add(port, LinkConfig())
        self.server_ports.append(port)
        self.proxies.append(proxy)
        return port, proxy

    def set_link(self, config: LinkConfig) -> None:
        for proxy in self.proxies:
            proxy.set_config(config)

    def check_all_through_proxies(self, bootstrap_port: int) -> dict[str, int]:
        """Raises `ChainError` if a server has an established connection that did not come through its proxy.

        libp2p dials out from its listening port (SO_REUSEPORT), so a server's own outgoing connections share its
        port too: allowed peers of a server's port are its proxy's upstream sockets (incoming, proxied), another
        server's proxy or the bootstrap node (outgoing). Anything else, such as a client or another server reaching
        the port directly, is a bypass. (A connection with the bootstrap node looks the same in either direction; it
        carries DHT traffic only, never a token.)"""
        outgoing_ok = {p.port for p in self.proxies} | {bootstrap_port}
        accepted = outgoing = 0
        for port, proxy in zip(self.server_ports, self.proxies, strict=True):
            remotes = established_remote_ports(port)
            upstream = proxy.upstream_ports()
            stray = {r for r in remotes if r not in upstream and r not in outgoing_ok}
            if stray:
                raise ChainError(f"connections to server port {port} around its proxy, from ports {sorted(stray)}")
            accepted += sum(r in upstream for r in remotes)
            outgoing += sum(r not in upstream for r in remotes)
        return {
            "via_proxy": accepted,
            "outgoing": outgoing,
            "proxy_connections_total": sum(p.stats.connections for p in self.proxies),
        }

    @staticmethod
    def _port_of(maddr: str) -> int:
        parts = maddr.split("/")
        return int(parts[parts.index("tcp") + 1])


class CorollaChain(_Chain):
    """`with CorollaChain(wan, workdir, model, 3, 4) as chain:` n corolla servers, each behind its proxy."""

    def __init__(
        self,
        wan: ProxyThread,
        workdir: Path,
        model: Path,
        num_servers: int,
        num_blocks: int,
        *,
        startup_timeout_s: float = 240.0,
    ):
        super().__init__(wan, workdir, num_servers, num_blocks)
        server_args = (
            "--device", "cpu", "--torch_dtype", "float32", "--throughput", "1.0", "--no_local_socket",
            "--mean_block_selection_delay", "0.2", "--update_period", "10", "--cache_dir", str(workdir / "cache"),
        )  # fmt: skip
        self.swarm = LocalSwarm(
            LocalSwarmConfig(
                server_args=server_args, startup_timeout_s=startup_timeout_s, log_dir=workdir, stop_grace_s=5.0
            )
        )
        try:
            self.swarm.start_bootstrap()
            for start, end in self.ranges:
                port, proxy = self._add_proxy()
                self.swarm.start_server(
                    model,
                    "--host_maddrs", f"/ip4/127.0.0.1/tcp/{port}",
                    "--announce_maddrs", f"/ip4/127.0.0.1/tcp/{proxy.port}",
                    block_indices=(start, end), wait=False,
                )  # fmt: skip
            self.swarm.wait_servers_ready()
        except BaseException:
            self.swarm.close()
            raise
        for server, proxy in zip(self.swarm.servers, self.proxies, strict=True):
            if any(f"/tcp/{proxy.port}/" not in addr for addr in server.initial_peers):
                self.swarm.close()
                raise ChainError(
                    f"server {server.peer_id} gives addresses other than its proxy's: {server.initial_peers}"
                )


class PetalsChain(_Chain):
    """n stock Petals 2.2 servers (the Petals venv's `python`), each behind its proxy, on a corolla bootstrap node."""

    def __init__(
        self,
        wan: ProxyThread,
        workdir: Path,
        model: Path,
        num_servers: int,
        num_blocks: int,
        *,
        petals_python: Path,
        dht_prefix: str,
        startup_timeout_s: float = 240.0,
    ):
        super().__init__(wan, workdir, num_servers, num_blocks)
        self.swarm = LocalSwarm(LocalSwarmConfig(log_dir=workdir, startup_timeout_s=startup_timeout_s))
        self.servers: list[ChildProcess] = []
        try:
            self.swarm.start_bootstrap()
            for i, (start, end) in enumerate(self.ranges):
                port, proxy = self._add_proxy()
                args: Sequence[str] = [
                    str(petals_python), str(PETALS_DRIVER), "server", "--model", str(model),
                    "--dht_prefix", dht_prefix, "--block_indices", f"{start}:{end}",
                    "--initial_peers", *self.swarm.initial_peers, "--host_port", str(port),
                    "--announce_port", str(proxy.port), "--cache_dir", str(workdir / "petals-cache"),
                ]  # fmt: skip
                server = ChildProcess(args, name=f"petals{i}", log_path=workdir / f"petals{i}.log")
                self.swarm.processes.append(server)
                self.servers.append(server)
            for server, proxy in zip(self.servers, self.proxies, strict=True):
                line = server.wait_for_line(lambda s: s.startswith(PETALS_READY), startup_timeout_s)
                maddrs = line.split("maddrs=", 1)[1].split()
                if not maddrs or any(f"/tcp/{proxy.port}/" not in a for a in maddrs):
                    raise ChainError(f"petals server gives addresses other than its proxy's: {maddrs}")
        except BaseException:
            self.swarm.close()
            raise


def petals_python_default() -> Path:
    """The interop venv's interpreter next to this checkout (`.venv-petals/bin/python`)."""
    return Path(sys.prefix).parent / ".venv-petals" / "bin" / "python"

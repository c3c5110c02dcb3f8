"""What peers see of the swarm: every server's last announced record as `RemoteSpanInfo`s (JOINING and ONLINE for
placement, ONLINE for routing), a version that changes whenever a record does, block coverage, each client
region's RTTs to servers (clients of one region share them), and the clients' view: ONLINE spans as of the last
refresh (clients re-read the DHT every `update_period_s`, or at once when a block is missing from their view)."""

from __future__ import annotations

from benchmarks.sim.regions import REGIONS, RttModel
from benchmarks.sim.server_model import SimServer
from corolla.protocol.records import RemoteSpanInfo, ServerState


class SwarmView:
    def __init__(self, num_blocks: int, rtt: RttModel):
        self.num_blocks = num_blocks
        self.rtt = rtt
        self.version = 0
        self.servers: dict[str, SimServer] = {}  # announced (JOINING or ONLINE), by peer id
        self.client_rtts_s: dict[str, dict[str, float]] = {region: {} for region in REGIONS}
        self._cache_version = -1
        self._placement: list[RemoteSpanInfo] = []
        self._routing: list[RemoteSpanInfo] = []
        self.client_version = 0
        self._client_spans: list[RemoteSpanInfo] = []
        self.fakes: list[RemoteSpanInfo] = []  # made-up records (`client_book.fake_records`): clients read them too

    def refresh_client_view(self) -> None:
        self._client_spans = self.client_records()
        self.client_version += 1

    def client_records(self) -> list[RemoteSpanInfo]:
        """What a client reads of the records now: the ONLINE servers' and the made-up ones."""
        return self.routing_spans() + self.fakes if self.fakes else self.routing_spans()

    def client_spans(self) -> list[RemoteSpanInfo]:
        return self._client_spans

    def announce(self, server: SimServer, now_s: float) -> None:
        """Publishes `server`'s current record (or withdraws it once it has left or gone OFFLINE)."""
        if server.state is None or server.state == ServerState.OFFLINE:
            if self.servers.pop(server.peer_id, None) is not None:
                for rtts in self.client_rtts_s.values():
                    rtts.pop(server.peer_id, None)
        else:
            if server.peer_id not in self.servers:
                for region, rtts in self.client_rtts_s.items():
                    rtts[server.peer_id] = self.rtt.rtt_s(f"client@{region}", region, server.peer_id, server.region)
            self.servers[server.peer_id] = server
            server.make_info()
            server.announced_s = now_s
        self.version += 1

    def refresh_all(self, now_s: float) -> None:
        """Every server re-announces (the periodic heartbeat that carries cache and load figures)."""
        for server in self.servers.values():
            server.make_info()
            server.announced_s = now_s
        self.version += 1

    def refresh_one(self, server: SimServer, now_s: float) -> None:
        """`server` re-announces its figures early (`swarm.early_announce`)."""
        server.make_info()
        server.announced_s = now_s
        self.version += 1

    def _rebuild(self) -> None:
        if self._cache_version == self.version:
            return
        self._placement, self._routing = [], []
        for peer_id in sorted(self.servers):
            server = self.servers[peer_id]
            assert server.info is not None, "an announced server has a record"
            span = RemoteSpanInfo(peer_id, server.start, server.end, server.info)
            self._placement.append(span)
            if server.state == ServerState.ONLINE:
                self._routing.append(span)
        self._cache_version = self.version

    def placement_spans(self) -> list[RemoteSpanInfo]:
        self._rebuild()
        return self._placement

    def routing_spans(self) -> list[RemoteSpanInfo]:
        self._rebuild()
        return self._routing

    def covered(self) -> bool:
        """True when ONLINE servers cover every block."""
        covered = [False] * self.num_blocks
        for span in self.routing_spans():
            covered[span.start : span.end] = [True] * span.length
        return all(covered)

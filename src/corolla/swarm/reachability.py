"""Direct-reachability check for servers joining the public swarm, compatible with Petals' `ReachabilityProtocol`
(handle `"ReachabilityProtocol.rpc_check"`, `dht_pb2.PingRequest`/`PingResponse`): a peer asks others to dial it
back through a fresh connection. Private swarms skip the check entirely (`check_direct_reachability` -> None). And the
public swarm's gate (`validate_reachability`): before going ONLINE, a server asks the swarm's health monitor whether it
can reach it, and refuses to serve (with advice) when it can't; a monitor that is down skips the check."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
import urllib.request
from collections.abc import Sequence

import hivemind
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import dht_pb2

from corolla.swarm.dht import SwarmConfig, install_p2pd_deathsig, replicate_p2p
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

CHECK_TIMEOUT_S = 5.0  # asking a peer to check us
THIRD_PARTY_CHECK_TIMEOUT_S = 10.0  # a peer asks us to dial it back
REACHABILITY_API_URL = "https://health.petals.dev"
REACHABILITY_WAIT_S = 420.0
REACHABILITY_RETRY_S = 15.0


class ReachabilityProtocol(ServicerBase):
    """Answers "can you reach peer X directly?" by dialing X through `probe`, a P2P with no prior connections."""

    def __init__(self, *, probe: P2P):
        self.probe = probe

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        name = f"ReachabilityProtocol.{method_name}"  # fixed, whatever a subclass is called
        return name if namespace is None else f"{namespace}::{name}"

    async def rpc_check(self, request: dht_pb2.PingRequest, context: P2PContext) -> dht_pb2.PingResponse:
        response = dht_pb2.PingResponse(peer=request.peer, available=False)
        if not request.peer.node_id:
            return response
        try:
            target = PeerID(request.peer.node_id)
        except Exception:
            return response
        if target == context.local_id:
            response.available = True
        else:
            response.available = bool(
                await call_check(self.probe, target, check_peer=target, timeout_s=THIRD_PARTY_CHECK_TIMEOUT_S)
            )
        return response


async def call_check(p2p: P2P, remote_peer: PeerID, *, check_peer: PeerID, timeout_s: float) -> bool | None:
    """Asks `remote_peer` whether it can reach `check_peer`; None if it did not answer."""
    try:
        request = dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(node_id=check_peer.to_bytes()))
        response = await ReachabilityProtocol.get_stub(p2p, remote_peer).rpc_check(request, timeout=timeout_s)
        return response.available
    except Exception as e:
        logger.debug(f"reachability.no_answer(peer={remote_peer}): {e!r:.200}")
        return None


async def _create_probe(initial_peers: list[str]) -> P2P:
    """A listen-less client P2P that finds third parties through the libp2p DHT of `initial_peers`: it has no
    connection to them yet, so reaching them proves they accept direct dials."""
    return await P2P.create(
        initial_peers or None, dht_mode="client", use_relay=False, auto_nat=False, nat_port_map=False, no_listen=True,
        startup_timeout=30,
    )  # fmt: skip


async def _known_maddrs(p2p: P2P) -> list[str]:
    maddrs = [str(m) for m in await p2p.get_visible_maddrs(latest=True)]
    for info in await p2p.list_peers():
        maddrs.extend(f"{addr}/p2p/{info.peer_id}" for addr in info.addrs)
    return maddrs


async def _check_async(config: SwarmConfig, max_peers: int, threshold: float) -> bool | None:
    kwargs = config.dht_kwargs()
    # a temporary client-mode node with our listen/announce addresses; not our identity (the real DHT takes it later)
    kwargs.update(client_mode=True, use_relay=False, use_auto_relay=False, identity_path=None)
    kwargs.pop("num_workers", None)
    node = await DHTNode.create(**kwargs)
    try:
        protocol = ReachabilityProtocol(probe=node.p2p)  # it only needs to answer "yes, that's me"
        await protocol.add_p2p_handlers(node.p2p)
        successes = answers = 0
        for remote_peer in list(node.protocol.routing_table.peer_id_to_uid.keys()):
            available = await call_check(node.p2p, remote_peer, check_peer=node.peer_id, timeout_s=CHECK_TIMEOUT_S)
            if available is None:
                continue
            answers += 1
            successes += available
            if answers >= max_peers:
                break
        return successes / answers >= threshold if answers else None
    finally:
        await node.shutdown()


def check_direct_reachability(
    config: SwarmConfig | Sequence[str],
    *,
    max_peers: int = 5,
    threshold: float = 0.5,
    timeout_s: float = 90.0,
    force: bool = False,
) -> bool | None:
    """True if most peers asked (up to `max_peers`) reached a temporary node with our network options directly;
    False if not (use relays); None if nobody answered or the swarm is private (skipped unless `force`).

    `config` is the node's SwarmConfig (its listen/announce addresses are tested) or just a list of initial peers."""
    if not isinstance(config, SwarmConfig):
        config = SwarmConfig(initial_peers=list(config))
    if not (config.is_public or force):
        return None
    install_p2pd_deathsig()
    future: concurrent.futures.Future[bool | None] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(asyncio.run(asyncio.wait_for(_check_async(config, max_peers, threshold), timeout_s)))
        except BaseException as e:
            future.set_exception(e)

    thread = threading.Thread(target=run, name="reachability-check", daemon=True)
    thread.start()
    try:
        return future.result(timeout=timeout_s + 10)
    except Exception as e:
        logger.warning(f"reachability.check_failed: {e!r:.200}; assuming direct reachability is unknown")
        return None


class ReachabilityService:
    """Serves `ReachabilityProtocol` on a replica of a DHT's P2P from a daemon thread (attach with
    `attach_reachability_protocol`); `shutdown()` stops it."""

    def __init__(self, dht: hivemind.DHT, *, startup_timeout_s: float = 60.0):
        self._dht = dht
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="reachability-protocol", daemon=True)
        install_p2pd_deathsig()
        self._thread.start()
        self._ready.result(timeout=startup_timeout_s)

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        try:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            replica = await replicate_p2p(self._dht, timeout_s=30)
            probe = await _create_probe(await _known_maddrs(replica))
            protocol = ReachabilityProtocol(probe=probe)
            await protocol.add_p2p_handlers(replica)
        except BaseException as e:
            self._ready.set_exception(e)
            return
        self._ready.set_result(None)
        try:
            await self._stop.wait()
        finally:
            await protocol.remove_p2p_handlers(replica)
            await probe.shutdown()
            await replica.shutdown()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)


def attach_reachability_protocol(dht: hivemind.DHT) -> ReachabilityService:
    """Lets other peers ask this DHT node whether they are directly reachable (bootstrap nodes, servers)."""
    return ReachabilityService(dht)


def validate_reachability(peer_id: str) -> None:
    """Asks the health monitor whether it reaches `peer_id`, retrying for up to 7 minutes (RuntimeError then)."""
    deadline = time.monotonic() + REACHABILITY_WAIT_S
    url = f"{REACHABILITY_API_URL}/api/v1/is_reachable/{peer_id}"
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                answer = json.loads(response.read())
        except Exception as e:
            logger.info(f"server.reachability_validation_skipped({e!r:.200})")
            return
        if answer.get("success"):
            logger.info("server.reachable(health monitor reached us directly)")
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"The swarm can't reach this server: {answer.get('message')}. Open a port and pass "
                f"--port <port> (and --public_ip {answer.get('your_ip', '<your ip>')} if behind NAT)"
            )
        logger.info("server.not_reachable_yet(retrying; relays may take a while)")
        time.sleep(REACHABILITY_RETRY_S)

"""Who may call this server: the membership gate of a private swarm (`PeerAuth`: every RPC carries a proof bound to
the sender's libp2p peer id and ours). What a pushed step may do is the core's (`core.push_guard`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from corolla.protocol.auth import MEMBER_PROOF_KEY, MemberProof, split_info_uid
from corolla.protocol.metadata import decode_metadata
from corolla.server.metrics import ServerMetrics
from corolla.swarm.membership import MembershipError, RpcMembership, SwarmKey
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


def remote_peer(context: P2PContext | None) -> str | None:
    """The libp2p-authenticated sender (base58), or None for the same-user unix socket (`local_endpoint`)."""
    remote_id = getattr(context, "remote_id", None)
    return None if remote_id is None else remote_id.to_base58()


class PeerAuth:
    """The membership gate of a server in a private swarm. Requests from the same-user unix socket (no libp2p
    sender) pass: only this OS user can open it, and that user can read the swarm key file anyway."""

    def __init__(self, membership: RpcMembership, local_peer_id: str, metrics: ServerMetrics | None = None):
        self.membership = membership
        self.local_peer_id = local_peer_id
        self.metrics = metrics

    def _refuse(self, rpc_name: str, sender: str | None, error: Exception) -> MembershipError:
        if self.metrics is not None:
            self.metrics.rejected("not_member")
        logger.info(f"{rpc_name}.refused_not_member(peer={str(sender)[-8:]}): {error}")
        return error if isinstance(error, MembershipError) else MembershipError(str(error))

    def check_proof(self, rpc_name: str, context: P2PContext | None, raw_proof: Any) -> None:
        sender = remote_peer(context)
        if sender is None:
            return
        try:
            proof = None if raw_proof is None else MemberProof.from_wire(raw_proof)
            self.membership.verify(proof, sender=sender, receiver=self.local_peer_id)
        except (ValueError, MembershipError) as e:
            raise self._refuse(rpc_name, sender, e) from None

    def check_metadata(self, rpc_name: str, context: P2PContext | None, raw_metadata: bytes) -> None:
        """MembershipError unless the metadata carries a valid proof from the context's sender to this server."""
        if remote_peer(context) is None:
            return
        try:
            raw_proof = decode_metadata(raw_metadata).get(MEMBER_PROOF_KEY)
        except ValueError as e:
            raise self._refuse(rpc_name, remote_peer(context), e) from None
        self.check_proof(rpc_name, context, raw_proof)

    def check_info_uid(self, context: P2PContext | None, uid: str) -> str:
        """The plain uid of an `rpc_info` request after checking the proof appended to it (rpc_info has no metadata)."""
        plain, proof_text = split_info_uid(uid)
        try:
            raw = None if proof_text is None else MemberProof.from_text(proof_text).to_wire()
        except ValueError as e:
            raise self._refuse("rpc_info", remote_peer(context), e) from None
        self.check_proof("rpc_info", context, raw)
        return plain

    def proof_metadata(self, receiver: str) -> dict[str, Any]:
        """Metadata entries proving our membership to `receiver` (for the pushes this server sends)."""
        proof = self.membership.make_proof(sender=self.local_peer_id, receiver=receiver)
        return {MEMBER_PROOF_KEY: proof.to_wire()}


def make_peer_auth(key: SwarmKey | None, local_peer_id: str, metrics: ServerMetrics | None = None) -> PeerAuth | None:
    """The membership gate of a server with swarm key `key`; None (no gate) for an open swarm."""
    if key is None:
        return None
    logger.info(f"peer_auth.private_swarm(key={key.fingerprint}): every RPC must prove membership")
    return PeerAuth(RpcMembership(key), local_peer_id, metrics)


def check_request(
    auth: PeerAuth | None, rpc_name: str, context: P2PContext | None, request: runtime_pb2.ExpertRequest
) -> None:
    """No-op in an open swarm; else MembershipError unless `request` proves its sender is a member."""
    if auth is not None:
        auth.check_metadata(rpc_name, context, request.metadata)


def gate_stream(
    auth: PeerAuth | None,
    rpc_name: str,
    requests: AsyncIterator[runtime_pb2.ExpertRequest],
    context: P2PContext | None,
) -> AsyncIterator[runtime_pb2.ExpertRequest]:
    """`requests`, after checking the membership proof in the first message; in an open swarm `requests` itself
    (no generator layer around every message of a stream)."""
    if auth is None:
        return requests
    return _gated(auth, rpc_name, requests, context)


async def _gated(
    auth: PeerAuth,
    rpc_name: str,
    requests: AsyncIterator[runtime_pb2.ExpertRequest],
    context: P2PContext | None,
) -> AsyncIterator[runtime_pb2.ExpertRequest]:
    first = True
    async for request in requests:
        if first:
            auth.check_metadata(rpc_name, context, request.metadata)
            first = False
        yield request


def info_uid(auth: PeerAuth | None, context: P2PContext | None, uid: str) -> str:
    """The uid an `rpc_info` asks about (checked and stripped of its proof in a private swarm)."""
    return uid if auth is None else auth.check_info_uid(context, uid)

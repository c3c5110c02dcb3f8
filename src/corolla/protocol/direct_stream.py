"""The direct inference stream: `rpc_inference` between a corolla client and a corolla server over a plain TCP
connection to the server's direct port, without the two p2pd daemons (decision 0006). Trust comes from p2p: the
client fetches a ticket there (`rpc_direct_ticket`), MACed under a secret only the server holds (no ticket table;
every handler process checks any). Both proofs and both directions' keys are MACs of the transcript under the ticket
key, which never crosses the link; frames are AES-GCM sealed in order. The handshake: docs/contracts.md's
`direct_stream`."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import struct
import time
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from corolla.protocol import local_stream as ls

DIRECT_STREAM_VERSION = 2  # 2: the client proves the ticket key before the server takes a connection slot
TICKET_TTL_S = 600
SECRET_BYTES = 32
KEY_BYTES = 32
NONCE_BYTES = 16
MAC_BYTES = 16
TAG_BYTES = 16  # AES-GCM's tag: what sealing adds to each payload
MAX_PEER_ID_BYTES = 128
MAX_TOKEN_BYTES = 1 + 4 + 1 + MAX_PEER_ID_BYTES + NONCE_BYTES + MAC_BYTES
MAX_HOSTS = 8
MAX_HOST_BYTES = 255
_EXPIRY = struct.Struct(">BI")  # token version, expiry (unix seconds)


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, label + b"".join(parts), hashlib.sha256).digest()


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _peer_id_bytes(peer_id: str) -> bytes:
    raw = peer_id.encode("ascii", errors="replace")
    if not peer_id.isalnum() or not 0 < len(raw) <= MAX_PEER_ID_BYTES:
        raise ValueError(f"peer id must be 1-{MAX_PEER_ID_BYTES} base58 characters, got {peer_id!r:.80}")
    return raw


@dataclass(frozen=True)
class Ticket:
    """What `rpc_direct_ticket` gives its caller: the token to present and the key only the caller shares."""

    token: bytes
    key: bytes
    expires_at_s: int


class TicketSecret:
    """The server's secret (random per run; every handler process of the server holds the same one). Issues
    tickets and checks the tokens that come back on direct connections."""

    def __init__(self, secret: bytes | None = None):
        if secret is not None and len(secret) != SECRET_BYTES:
            raise ValueError(f"a ticket secret is {SECRET_BYTES} bytes, got {len(secret)}")
        self.secret = secret if secret is not None else os.urandom(SECRET_BYTES)

    def issue(self, peer_id: str, *, ttl_s: int = TICKET_TTL_S, now_s: float | None = None) -> Ticket:
        """A ticket for the (p2p-authenticated) peer `peer_id`, valid for `ttl_s` seconds."""
        expires_at = int(now_s if now_s is not None else time.time()) + ttl_s
        raw = _peer_id_bytes(peer_id)
        body = _EXPIRY.pack(DIRECT_STREAM_VERSION, expires_at) + bytes([len(raw)]) + raw + os.urandom(NONCE_BYTES)
        token = body + _mac(self.secret, b"corolla-direct-token", body)[:MAC_BYTES]
        return Ticket(token=token, key=_mac(self.secret, b"corolla-direct-key", token), expires_at_s=expires_at)

    def check(self, token: bytes, *, now_s: float | None = None) -> tuple[str, bytes]:
        """(the peer id the token was issued to, its ticket key); ValueError for a malformed, forged or expired
        token (the MAC is checked before anything in the token is believed)."""
        if not _EXPIRY.size + 1 + NONCE_BYTES + MAC_BYTES < len(token) <= MAX_TOKEN_BYTES:
            raise ValueError(f"a direct ticket token is at most {MAX_TOKEN_BYTES} bytes, got {len(token)}")
        body, mac = token[:-MAC_BYTES], token[-MAC_BYTES:]
        if not hmac.compare_digest(mac, _mac(self.secret, b"corolla-direct-token", body)[:MAC_BYTES]):
            raise ValueError("the direct ticket was not issued by this server")
        version, expires_at = _EXPIRY.unpack_from(body)
        length = body[_EXPIRY.size]
        if version != DIRECT_STREAM_VERSION or len(body) != _EXPIRY.size + 1 + length + NONCE_BYTES:
            raise ValueError("the direct ticket has an unknown layout")
        if expires_at < (now_s if now_s is not None else time.time()):
            raise ValueError("the direct ticket has expired")
        peer_id = body[_EXPIRY.size + 1 : _EXPIRY.size + 1 + length].decode("ascii")
        return peer_id, _mac(self.secret, b"corolla-direct-key", token)


# ---- what the ticket RPC answers (a few fields in ExpertInfo.serialized_info, msgpack)


@dataclass(frozen=True)
class DirectOffer:
    """A server's direct port and the caller's ticket: the client connects to one of `hosts` at `port`."""

    hosts: tuple[str, ...]
    port: int
    ticket: Ticket

    def to_dict(self) -> dict:
        return {
            "version": DIRECT_STREAM_VERSION,
            "hosts": list(self.hosts),
            "port": self.port,
            "token": self.ticket.token,
            "key": self.ticket.key,
            "expires_at": self.ticket.expires_at_s,
        }

    @classmethod
    def from_dict(cls, data: object) -> DirectOffer:
        """ValueError for anything but what a corolla server sends (bounded: a hostile server's answer)."""
        if not isinstance(data, dict) or data.get("version") != DIRECT_STREAM_VERSION:
            raise ValueError("not a direct offer of a known version")
        hosts, port, token, key, expires = (data.get(k) for k in ("hosts", "port", "token", "key", "expires_at"))
        if not isinstance(hosts, list) or not 0 < len(hosts) <= MAX_HOSTS:
            raise ValueError(f"a direct offer names 1-{MAX_HOSTS} hosts")
        if not all(isinstance(h, str) and 0 < len(h) <= MAX_HOST_BYTES and _is_ip(h) for h in hosts):
            raise ValueError("a direct offer's hosts are IP addresses (a client resolves no names it is given)")
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"a direct offer's port must be 1-65535, got {port!r:.20}")
        if not isinstance(token, bytes) or not 0 < len(token) <= MAX_TOKEN_BYTES:
            raise ValueError(f"a direct offer's token is 1-{MAX_TOKEN_BYTES} bytes")
        if not isinstance(key, bytes) or len(key) != KEY_BYTES or not isinstance(expires, int):
            raise ValueError(f"a direct offer's key is {KEY_BYTES} bytes and its expiry an integer")
        return cls(hosts=tuple(hosts), port=port, ticket=Ticket(token=token, key=key, expires_at_s=expires))


# ---- the connection's first frames


@dataclass(frozen=True)
class DirectHello:
    """The client's first frame (plain): which rpc, which server it expects, its token and nonce."""

    rpc: str
    peer_id: str  # the server's
    token: bytes
    client_nonce: bytes
    version: int = DIRECT_STREAM_VERSION

    def to_bytes(self) -> bytes:
        rpc, peer = self.rpc.encode(), _peer_id_bytes(self.peer_id)
        return b"".join(
            (
                struct.pack(">BB", self.version, len(rpc)),
                rpc,
                bytes([len(peer)]),
                peer,
                struct.pack(">H", len(self.token)),
                self.token,
                self.client_nonce,
            )
        )

    @classmethod
    def from_bytes(cls, payload: bytes) -> DirectHello:
        """ValueError for a hello no corolla client sends (every length checked against what is left)."""
        try:
            version, rpc_len = struct.unpack_from(">BB", payload)
            at = 2
            rpc = payload[at : at + rpc_len].decode("ascii")
            at += rpc_len
            peer_len = payload[at]
            peer = payload[at + 1 : at + 1 + peer_len].decode("ascii")
            at += 1 + peer_len
            (token_len,) = struct.unpack_from(">H", payload, at)
            at += 2
            token, nonce = payload[at : at + token_len], payload[at + token_len :]
        except (struct.error, IndexError, UnicodeDecodeError) as e:
            raise ValueError(f"direct hello is malformed: {e}") from None
        if len(rpc) != rpc_len or len(peer) != peer_len or len(token) != token_len or len(nonce) != NONCE_BYTES:
            raise ValueError("direct hello's lengths do not match its bytes")
        if token_len > MAX_TOKEN_BYTES:
            raise ValueError(f"direct hello's token exceeds {MAX_TOKEN_BYTES} bytes")
        return cls(rpc=rpc, peer_id=peer, token=token, client_nonce=nonce, version=version)


@dataclass(frozen=True)
class StreamKeys:
    """One connection's secrets, each a MAC under the ticket key of the transcript (the hello's bytes and the server
    nonce) under a label of its own: the two directions' keys and the two proofs of the ticket key."""

    client_to_server: bytes
    server_to_client: bytes
    server_proof: bytes  # sent with the server nonce: the client uses the stream only with a server that knows the key
    client_proof: bytes  # the client's answer: checked before the server takes a connection slot for the ticket's peer

    @classmethod
    def derive(cls, ticket_key: bytes, hello: bytes, server_nonce: bytes) -> StreamKeys:
        """`hello`: the HELLO frame's payload as sent (`DirectHello.to_bytes`), client nonce included."""
        if len(server_nonce) != NONCE_BYTES:
            raise ValueError(f"a direct stream's server nonce is {NONCE_BYTES} bytes")
        transcript = hashlib.sha256(hello + server_nonce).digest()
        return cls(
            client_to_server=_mac(ticket_key, b"corolla-direct-c2s", transcript),
            server_to_client=_mac(ticket_key, b"corolla-direct-s2c", transcript),
            server_proof=_mac(ticket_key, b"corolla-direct-server-proof", transcript)[:MAC_BYTES],
            client_proof=_mac(ticket_key, b"corolla-direct-client-proof", transcript)[:MAC_BYTES],
        )


def challenge_payload(server_nonce: bytes, keys: StreamKeys) -> bytes:
    """The server's first ACCEPT: its nonce and its proof."""
    return server_nonce + keys.server_proof


def parse_challenge(payload: bytes) -> tuple[bytes, bytes]:
    """(server nonce, server proof) of the server's first ACCEPT; ValueError if it has the wrong size."""
    if len(payload) != NONCE_BYTES + MAC_BYTES:
        raise ValueError(f"a direct challenge is {NONCE_BYTES + MAC_BYTES} bytes, got {len(payload)}")
    return payload[:NONCE_BYTES], payload[NONCE_BYTES:]


def proof_matches(expected: bytes, received: bytes) -> bool:
    """Whether a received proof is the expected one (constant time; a proof of another size never matches)."""
    return len(received) == MAC_BYTES and hmac.compare_digest(expected, received)


# ---- sealed frames


class Sealer:
    """One direction's sending side: each frame's payload sealed under the next counter."""

    def __init__(self, key: bytes):
        self._aead = AESGCM(key)
        self._counter = 0

    def seal(self, kind: int, payload: bytes = b"") -> bytes:
        """The whole frame: header (kind, sealed length) and the sealed payload."""
        header = ls.header(kind, len(payload) + TAG_BYTES)
        nonce = self._counter.to_bytes(12, "big")
        self._counter += 1
        return header + self._aead.encrypt(nonce, payload, header)


class Opener:
    """One direction's receiving side: opens frames in the order they were sealed (anything else fails)."""

    def __init__(self, key: bytes):
        self._aead = AESGCM(key)
        self._counter = 0

    def open(self, kind: int, sealed: bytes) -> bytes:
        """The payload of a frame of `kind` whose sealed payload is `sealed`; ValueError if it does not open."""
        if len(sealed) < TAG_BYTES:
            raise ValueError("a sealed direct frame is shorter than its tag")
        header = ls.header(kind, len(sealed))
        nonce = self._counter.to_bytes(12, "big")
        try:
            payload = self._aead.decrypt(nonce, sealed, header)
        except InvalidTag:
            raise ValueError("a direct stream frame failed authentication") from None
        self._counter += 1
        return payload

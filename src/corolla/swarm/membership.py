"""Private swarms with membership: a shared swarm key (a file made by `corolla-dht --new_swarm_key PATH`) gates
every DHT request and response (`SwarmKeyAuthorizer`, hivemind's authorizer hook: HMAC, timestamp, nonce) and every
server RPC (`RpcMembership`: a proof in the request metadata bound to both peer ids, see `protocol.auth`).

Threat model: whoever holds the key is a member and can do anything a member can, including admitting others by
leaking the key; an outsider without it gets every DHT and RPC request refused and never enters a member's routing
table. Not hidden from outsiders: that a libp2p peer listens at a known address, and its peer id."""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import secrets
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, AuthorizerBase
from hivemind.utils.timed_storage import get_dht_time

from corolla.protocol.auth import MemberProof, proof_mac
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

SWARM_KEY_BYTES = 32
SWARM_KEY_HEADER = "corolla-swarm-key-v1"
DEFAULT_MAX_CLOCK_SKEW_S = 60.0  # requests and proofs older or newer than this are refused
DHT_NONCE_BYTES = 16
MAX_REMEMBERED_NONCES = 100_000  # only requests with a valid MAC are remembered, so only members fill this


class MembershipError(PermissionError):
    """A request without a valid membership proof (refused; counted as `not_member`)."""


@dataclass(frozen=True)
class SwarmKey:
    """The shared secret of a private swarm; subkeys for the DHT and for RPC proofs are derived from it."""

    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) != SWARM_KEY_BYTES:
            raise ValueError(f"a swarm key must be {SWARM_KEY_BYTES} bytes, got {len(self.secret)}")

    @classmethod
    def generate(cls) -> SwarmKey:
        return cls(secrets.token_bytes(SWARM_KEY_BYTES))

    def _derive(self, label: bytes) -> bytes:
        return hmac.new(self.secret, b"corolla-swarm-key/" + label, hashlib.sha256).digest()

    @property
    def dht_key(self) -> bytes:
        return self._derive(b"dht")

    @property
    def rpc_key(self) -> bytes:
        return self._derive(b"rpc")

    @property
    def fingerprint(self) -> str:
        """A short public name of the key for logs (reveals nothing useful about it)."""
        return self._derive(b"fingerprint").hex()[:12]

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Writes a new key file readable by its owner only; refuses to overwrite an existing file."""
        path = Path(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{SWARM_KEY_HEADER}\n{self.secret.hex()}\n")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SwarmKey:
        """Reads a key file; ValueError if it is not one (a warning if others may read it)."""
        path = Path(path)
        if path.stat().st_size > 1024:
            raise ValueError(f"{path} is not a swarm key file (larger than 1024 bytes)")
        lines = path.read_text().split()
        if len(lines) != 2 or lines[0] != SWARM_KEY_HEADER:
            raise ValueError(f"{path} is not a swarm key file (expected '{SWARM_KEY_HEADER}' and a hex key)")
        try:
            secret = bytes.fromhex(lines[1])
        except ValueError:
            raise ValueError(f"{path}: the swarm key must be hex") from None
        if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning(f"membership.key_file_readable_by_others(path={path}): chmod 600 it")
        return cls(secret)


def load_swarm_key(path: str | os.PathLike[str] | None) -> SwarmKey | None:
    """`SwarmKey.load(path)`, or None for the public/open path (no key file given)."""
    return SwarmKey.load(path) if path is not None and path != "" else None


class RpcMembership:
    """Makes and checks the membership proofs of server RPCs (`protocol.auth.MemberProof`)."""

    def __init__(self, key: SwarmKey, *, max_clock_skew_s: float = DEFAULT_MAX_CLOCK_SKEW_S):
        if not max_clock_skew_s > 0:
            raise ValueError(f"max_clock_skew_s must be > 0, got {max_clock_skew_s}")
        self._rpc_key = key.rpc_key
        self.max_clock_skew_s = max_clock_skew_s
        self.fingerprint = key.fingerprint

    def make_proof(self, *, sender: str, receiver: str, now_s: float | None = None) -> MemberProof:
        issued_at_ms = int((time.time() if now_s is None else now_s) * 1000)
        return MemberProof(
            issued_at_ms, proof_mac(self._rpc_key, sender=sender, receiver=receiver, issued_at_ms=issued_at_ms)
        )

    def verify(self, proof: MemberProof | None, *, sender: str, receiver: str, now_s: float | None = None) -> None:
        """Returns if `proof` was made with this swarm key by `sender` for `receiver` within the skew window;
        raises MembershipError otherwise."""
        if proof is None:
            raise MembershipError("this server serves a private swarm: the request carries no membership proof")
        now_ms = (time.time() if now_s is None else now_s) * 1000
        if abs(now_ms - proof.issued_at_ms) > self.max_clock_skew_s * 1000:
            raise MembershipError(
                f"membership proof is stale or from the future (allowed clock skew {self.max_clock_skew_s} s)"
            )
        expected = proof_mac(self._rpc_key, sender=sender, receiver=receiver, issued_at_ms=proof.issued_at_ms)
        if not hmac.compare_digest(expected, proof.mac):
            raise MembershipError("membership proof is not valid for this swarm, sender and receiver")


class SwarmKeyAuthorizer(AuthorizerBase):
    """hivemind DHT authorizer for a shared swarm key: each request carries time, a random nonce and an HMAC of the
    whole serialized request; each response an HMAC of itself bound to the request's nonce. Requests outside the
    clock-skew window, replayed nonces and bad MACs are refused (the servicer answers nothing useful).

    hivemind's authorizer API does not see libp2p peer ids, so they are not in the MAC; libp2p encrypts and
    authenticates every connection, so only a member (who holds the key anyway) could see a message to replay."""

    def __init__(self, key: SwarmKey, *, max_clock_skew_s: float = DEFAULT_MAX_CLOCK_SKEW_S):
        if not max_clock_skew_s > 0:
            raise ValueError(f"max_clock_skew_s must be > 0, got {max_clock_skew_s}")
        self._key = key.dht_key
        self.max_clock_skew_s = max_clock_skew_s
        self._nonces: collections.OrderedDict[bytes, float] = collections.OrderedDict()  # nonce -> forget after

    def _mac(self, label: bytes, message: bytes) -> bytes:
        return hmac.new(self._key, label + b"\0" + message, hashlib.sha256).digest()

    @staticmethod
    def _serialized_without_signature(message: AuthorizedRequestBase | AuthorizedResponseBase) -> tuple[bytes, bytes]:
        signature = message.auth.signature
        message.auth.signature = b""
        try:
            return message.SerializeToString(deterministic=True), signature
        finally:
            message.auth.signature = signature

    async def sign_request(self, request: AuthorizedRequestBase, service_public_key: object = None) -> None:
        auth = request.auth
        auth.time = get_dht_time()
        auth.nonce = secrets.token_bytes(DHT_NONCE_BYTES)
        auth.signature = b""
        auth.signature = self._mac(b"request", request.SerializeToString(deterministic=True))

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        payload, signature = self._serialized_without_signature(request)
        auth = request.auth
        now = get_dht_time()
        reason = None
        if not hmac.compare_digest(self._mac(b"request", payload), signature):
            reason = "bad_mac"
        elif abs(auth.time - now) > self.max_clock_skew_s:
            reason = "stale"
        elif len(auth.nonce) != DHT_NONCE_BYTES or self._seen(auth.nonce, now):
            reason = "replayed"
        if reason is not None:
            logger.debug(f"membership.dht_request_refused(reason={reason})")
            return False
        return True

    def _seen(self, nonce: bytes, now: float) -> bool:
        while self._nonces and (next(iter(self._nonces.values())) < now or len(self._nonces) >= MAX_REMEMBERED_NONCES):
            self._nonces.popitem(last=False)
        if nonce in self._nonces:
            return True
        self._nonces[nonce] = now + 2 * self.max_clock_skew_s  # past this, the request's time is refused anyway
        return False

    async def sign_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> None:
        auth = response.auth
        auth.nonce = request.auth.nonce
        auth.signature = b""
        auth.signature = self._mac(b"response", response.SerializeToString(deterministic=True))

    async def validate_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> bool:
        payload, signature = self._serialized_without_signature(response)
        valid = response.auth.nonce == request.auth.nonce and hmac.compare_digest(
            self._mac(b"response", payload), signature
        )
        if not valid:
            logger.debug("membership.dht_response_refused")
        return valid

"""corolla-only metadata keys that authenticate peers: the membership proof of a private swarm (an HMAC over sender
peer id, receiver peer id and issue time, keyed by the swarm key) and the upstream peer a client names for a session's
pushes. Stock Petals peers ignore unknown metadata keys, so both are wire-compatible extensions."""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from typing import Any

MEMBER_PROOF_KEY = "corolla.member"  # metadata key: MemberProof.to_wire()
UPSTREAM_PEER_KEY = "corolla.upstream_peer"  # metadata key: base58 peer id allowed to rpc_push into this session
INFO_PROOF_SEPARATOR = "#corolla.member="  # rpc_info has no metadata: members append the proof to ExpertUID.uid

PROOF_VERSION = 1
PROOF_MAC_BYTES = 32
MAX_PEER_ID_CHARS = 128  # base58 peer ids are ~46-53 characters
_BASE58 = re.compile(r"^[1-9A-HJ-NP-Za-km-z]+$")
_PROOF_DOMAIN = b"corolla-rpc-member-v1"


def validate_peer_id_text(value: Any, what: str) -> str:
    """A base58 peer id from the wire, or ValueError naming `what` and the limit."""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a base58 peer id string, got {type(value).__name__}")
    if not 0 < len(value) <= MAX_PEER_ID_CHARS or not _BASE58.match(value):
        raise ValueError(f"{what} must be a base58 peer id of at most {MAX_PEER_ID_CHARS} characters")
    return value


def parse_upstream_peer(metadata_extra: dict[str, Any]) -> str | None:
    """The upstream peer declared in a request's extra metadata (None when absent); ValueError when malformed."""
    value = metadata_extra.get(UPSTREAM_PEER_KEY)
    return None if value is None else validate_peer_id_text(value, UPSTREAM_PEER_KEY)


def proof_mac(rpc_key: bytes, *, sender: str, receiver: str, issued_at_ms: int) -> bytes:
    """HMAC-SHA256 binding a proof to who sends it, who receives it and when it was made."""
    message = b"\0".join((_PROOF_DOMAIN, sender.encode(), receiver.encode(), str(issued_at_ms).encode()))
    return hmac.new(rpc_key, message, hashlib.sha256).digest()


@dataclass(frozen=True)
class MemberProof:
    """Proof that the sender of a request knows the swarm key. Bound to (sender, receiver) peer ids, which libp2p
    authenticates, so a receiver cannot replay it to anyone else; fresh within the receiver's clock-skew window."""

    issued_at_ms: int
    mac: bytes

    def to_wire(self) -> list[Any]:
        return [PROOF_VERSION, self.issued_at_ms, self.mac]

    @classmethod
    def from_wire(cls, value: Any) -> MemberProof:
        """Parses the metadata value; ValueError on anything but `[1, int ms, 32 bytes]`."""
        if not isinstance(value, (list, tuple)) or len(value) != 3:
            raise ValueError(f"{MEMBER_PROOF_KEY} must be [version, issued_at_ms, mac]")
        version, issued_at_ms, mac = value
        if version != PROOF_VERSION:
            raise ValueError(f"{MEMBER_PROOF_KEY} version must be {PROOF_VERSION}")
        if isinstance(issued_at_ms, bool) or not isinstance(issued_at_ms, int) or not 0 <= issued_at_ms < 2**63:
            raise ValueError(f"{MEMBER_PROOF_KEY} issued_at_ms must be an int in [0, 2**63)")
        if not isinstance(mac, bytes) or len(mac) != PROOF_MAC_BYTES:
            raise ValueError(f"{MEMBER_PROOF_KEY} mac must be {PROOF_MAC_BYTES} bytes")
        return cls(issued_at_ms=issued_at_ms, mac=mac)

    def to_text(self) -> str:
        return f"{PROOF_VERSION}.{self.issued_at_ms}.{self.mac.hex()}"

    @classmethod
    def from_text(cls, text: str) -> MemberProof:
        parts = text.split(".")
        if len(parts) != 3 or len(text) > 20 + 2 * PROOF_MAC_BYTES + 4 or not parts[1].isdigit():
            raise ValueError(f"{MEMBER_PROOF_KEY} text must be 'version.issued_at_ms.mac_hex'")
        try:
            mac = bytes.fromhex(parts[2])
        except ValueError:
            raise ValueError(f"{MEMBER_PROOF_KEY} mac must be hex") from None
        return cls.from_wire([int(parts[0]) if parts[0].isdigit() else parts[0], int(parts[1]), mac])


def join_info_uid(uid: str, proof: MemberProof) -> str:
    """`ExpertUID.uid` carrying a proof (rpc_info of a private-swarm member; private servers only)."""
    return f"{uid}{INFO_PROOF_SEPARATOR}{proof.to_text()}"


def split_info_uid(uid: str) -> tuple[str, str | None]:
    """(plain uid, proof text or None) from an `ExpertUID.uid`."""
    plain, separator, proof = uid.partition(INFO_PROOF_SEPARATOR)
    return plain, (proof if separator else None)

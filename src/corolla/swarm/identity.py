"""A node's libp2p identity as a signing key: `RecordSigner` signs with the RSA key whose hash is the node's peer id,
`prepare_identity` gives every corolla DHT a key file the process can read (a fresh one in a private temporary
directory when no `identity_path` is given, removed once p2pd has loaded it), `get_signer(dht)` returns it."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import multihash
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2

from corolla.utils.logging import get_logger

logger = get_logger(__name__)

# the libp2p RSA signature scheme hivemind uses for its own signed records (`hivemind.utils.crypto`)
_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)
_HASH = hashes.SHA256()
MAX_PUBLIC_KEY_BYTES = 1024  # a libp2p RSA-4096 public key protobuf is ~550 bytes
MIN_RSA_KEY_BITS = 2048
MAX_RSA_KEY_BITS = 4096  # verification cost grows with the key: refuse larger keys from the network
_SIGNER_ATTRIBUTE = "_corolla_record_signer"


def peer_id_from_public_key(public_key_bytes: bytes) -> str:
    """The base58 peer id libp2p derives from a protobuf-serialized public key (sha2-256 multihash of the bytes)."""
    digest = multihash.encode(hashlib.sha256(public_key_bytes).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


def load_public_key(public_key_bytes: bytes) -> rsa.RSAPublicKey:
    """Parses a libp2p protobuf public key from the network; ValueError unless it is RSA of 2048..4096 bits."""
    if not isinstance(public_key_bytes, bytes) or len(public_key_bytes) > MAX_PUBLIC_KEY_BYTES:
        raise ValueError(f"public key must be at most {MAX_PUBLIC_KEY_BYTES} bytes")
    try:
        message = crypto_pb2.PublicKey.FromString(public_key_bytes)
        key = serialization.load_der_public_key(message.data)
    except Exception as e:  # protobuf and DER parsers raise their own error types on garbage
        raise ValueError(f"public key is not a libp2p protobuf DER key: {e!r:.100}") from None
    if message.key_type != crypto_pb2.KeyType.RSA or not isinstance(key, rsa.RSAPublicKey):
        raise ValueError("public key must be an RSA key")
    if not MIN_RSA_KEY_BITS <= key.key_size <= MAX_RSA_KEY_BITS:
        raise ValueError(f"RSA key size must be {MIN_RSA_KEY_BITS}..{MAX_RSA_KEY_BITS} bits, got {key.key_size}")
    return key


def verify_signature(public_key: rsa.RSAPublicKey, data: bytes, signature: bytes) -> bool:
    try:
        public_key.verify(signature, data, _PSS, _HASH)
        return True
    except Exception:  # InvalidSignature, or a malformed signature
        return False


class RecordSigner:
    """Signs on behalf of one peer id: the private half of the node's libp2p identity."""

    def __init__(self, private_key: rsa.RSAPrivateKey):
        self._private_key = private_key
        spki = private_key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        self.public_key_bytes = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.RSA, data=spki).SerializeToString()
        self.peer_id = peer_id_from_public_key(self.public_key_bytes)

    @classmethod
    def from_identity_bytes(cls, data: bytes) -> RecordSigner:
        """From the contents of a libp2p identity file (protobuf `PrivateKey` holding an RSA DER key)."""
        message = crypto_pb2.PrivateKey.FromString(data)
        if message.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError("only RSA identities can sign corolla records (hivemind generates RSA identities)")
        key = serialization.load_der_private_key(message.data, password=None)
        if not isinstance(key, rsa.RSAPrivateKey):
            raise ValueError("identity file does not hold an RSA private key")
        return cls(key)

    @classmethod
    def from_identity_file(cls, path: str | os.PathLike[str]) -> RecordSigner:
        return cls.from_identity_bytes(Path(path).read_bytes())

    @classmethod
    def generate(cls, key_size_bits: int = 2048) -> RecordSigner:
        return cls(rsa.generate_private_key(public_exponent=65537, key_size=key_size_bits))

    def identity_bytes(self) -> bytes:
        """The libp2p identity file contents for this key (what `P2P.generate_identity` writes)."""
        der = self._private_key.private_bytes(
            serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
        )
        return crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()

    def sign(self, data: bytes) -> bytes:
        return self._private_key.sign(data, _PSS, _HASH)

    def __reduce__(self) -> Any:  # picklable (the DHT process gets it through a pipe), never printed
        return (RecordSigner.from_identity_bytes, (self.identity_bytes(),))

    def __repr__(self) -> str:
        return f"RecordSigner(peer_id={self.peer_id})"


@dataclass
class PreparedIdentity:
    """The identity file a DHT is started with; `temporary_dir` is ours to remove once p2pd has read the file."""

    path: str
    temporary_dir: str | None

    def load_signer(self) -> RecordSigner | None:
        """Reads the key (after the DHT is ready: p2pd has created or read it); None if unreadable or not RSA."""
        try:
            return RecordSigner.from_identity_file(self.path)
        except Exception as e:
            logger.warning(f"identity.unreadable(path={self.path}): {e!r:.200}; records will not be signed")
            return None
        finally:
            self.cleanup()

    def cleanup(self) -> None:
        if self.temporary_dir is not None:
            shutil.rmtree(self.temporary_dir, ignore_errors=True)
            self.temporary_dir = None


_TEMPORARY_KEY_PREFIX = "corolla-identity-"


class _HideTemporaryKeyNotice(logging.Filter):
    """Drops hivemind's INFO line about generating a key file when the file is our own throw-away one (an
    implementation detail that would otherwise land in the middle of a CLI's output)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Generating new identity") and _TEMPORARY_KEY_PREFIX in message)


_hivemind_p2p_logger = logging.getLogger("hivemind.p2p.p2p_daemon")
if not any(isinstance(f, _HideTemporaryKeyNotice) for f in _hivemind_p2p_logger.filters):
    _hivemind_p2p_logger.addFilter(_HideTemporaryKeyNotice())


def prepare_identity(dht_kwargs: dict[str, Any]) -> PreparedIdentity:
    """Makes sure the DHT starts from a key file we can read. Without `identity_path`, points it at a path in a new
    0700 temporary directory: hivemind then generates the key there (no "identity taken" probe, since the file is
    new) and `load_signer` deletes it after start-up (p2pd has loaded it; the peer id lives as long as the DHT)."""
    path = dht_kwargs.get("identity_path")
    if path is not None:
        return PreparedIdentity(path=os.fspath(path), temporary_dir=None)
    directory = tempfile.mkdtemp(prefix=_TEMPORARY_KEY_PREFIX)  # mode 0700
    dht_kwargs["identity_path"] = os.path.join(directory, "identity.key")
    return PreparedIdentity(path=dht_kwargs["identity_path"], temporary_dir=directory)


def set_signer(dht: Any, signer: RecordSigner | None) -> None:
    setattr(dht, _SIGNER_ATTRIBUTE, signer)


def get_signer(dht: Any) -> RecordSigner | None:
    """The signer of a DHT made by `corolla.swarm.dht.create_dht` (None for other DHTs: records go unsigned)."""
    return getattr(dht, _SIGNER_ATTRIBUTE, None)

"""The same-host inference stream: `rpc_inference` between a corolla client and server on one machine over a unix socket
instead of two p2pd daemons (~1 ms per step on loopback). Messages are the p2p stream's protobufs; only framing
differs. Frames, socket paths and load files are docs/contracts.md's (`local_stream`). A client uses only sockets in a
directory owned by its own uid and closed to others, so only the same user (who could read the server's memory
anyway) can have put one there."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import stat
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

LOCAL_STREAM_VERSION = 1
SOCKET_DIR_ENV = "COROLLA_LOCAL_SOCKET_DIR"

HELLO, ACCEPT, MESSAGE, ERROR, END = 1, 2, 3, 4, 5
FRAME_KINDS = (HELLO, ACCEPT, MESSAGE, ERROR, END)
_HEADER = struct.Struct(">BI")
HEADER_BYTES = _HEADER.size  # 5
MAX_HELLO_BYTES = 4096
MAX_ERROR_BYTES = 64 * 1024
# an error's text: room left in MAX_ERROR_BYTES for a framing's envelope (a p2p `RPCError`'s field tag and length)
ERROR_TEXT_BYTES = MAX_ERROR_BYTES - 16
UNIX_PATH_MAX_BYTES = 107  # sun_path is 108 bytes on Linux, one for the NUL


def socket_dir() -> Path:
    """Where this user's servers put their sockets."""
    override = os.environ.get(SOCKET_DIR_ENV)
    if override:
        return Path(override)
    return Path(tempfile.gettempdir()) / f"corolla-{os.getuid()}"


def socket_path(peer_id: str, directory: Path | None = None, index: int | None = None) -> Path:
    """The socket of the server with base58 `peer_id` (of its handler process `index`, if given); ValueError for a
    peer id that is not a plain file name or a negative index."""
    if not peer_id or not peer_id.isalnum():
        raise ValueError(f"peer id must be a non-empty base58 string, got {peer_id!r:.80}")
    if index is not None and index < 0:
        raise ValueError(f"handler index must be >= 0, got {index}")
    name = f"{peer_id}.sock" if index is None else f"{peer_id}.{index}.sock"
    return (directory if directory is not None else socket_dir()) / name


def _peer_sockets(peer_id: str, directory: Path) -> list[Path]:
    """Every name in `directory` that is `peer_id`'s socket or one of its handler processes' (not checked)."""
    pattern = re.compile(re.escape(peer_id) + r"(\.\d{1,4})?\.sock")
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(directory / name for name in names if pattern.fullmatch(name))


MAX_LOAD_FILE_BYTES = 32
MAX_LOAD = 1_000_000  # a count above this in a load file is garbage


def load_path(socket: Path) -> Path:
    """The load file of a handler process's socket: `<socket>.load`."""
    return socket.with_name(socket.name + ".load")


class StreamLoad:
    """A handler process's load file: the number of connections it serves now, rewritten in place (fixed width, one
    `pwrite`) whenever it changes: `open` (or `with`) makes it, `close` removes it."""

    def __init__(self, socket: Path):
        self.path = load_path(socket)
        self._fd: int | None = None

    def open(self) -> StreamLoad:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # one left by an earlier run (O_EXCL below then cannot meet a planted link)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        self.write(0)
        return self

    def __enter__(self) -> StreamLoad:
        return self.open()

    def write(self, count: int) -> None:
        if self._fd is not None:
            os.pwrite(self._fd, b"%10d\n" % count, 0)

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


def read_load(socket: Path) -> int | None:
    """The connections the handler process behind `socket` serves, from its load file; None where there is none or
    it says nothing sensible (not a regular file, too long, not a count in [0, MAX_LOAD])."""
    try:
        fd = os.open(load_path(socket), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, MAX_LOAD_FILE_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) > MAX_LOAD_FILE_BYTES:
        return None
    try:
        count = int(data.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        return None
    return count if 0 <= count <= MAX_LOAD else None


def remove_sockets(peer_id: str, directory: Path | None = None) -> int:
    """Removes the sockets an earlier run with this identity left (a server does this before listening, so that
    no client tries a socket of a handler process that no longer exists); returns how many."""
    directory = directory if directory is not None else socket_dir()
    if not peer_id.isalnum() or not is_private_dir(directory):
        return 0
    removed = 0
    for path in _peer_sockets(peer_id, directory):
        with contextlib.suppress(OSError):
            path.unlink()
            removed += 1
        with contextlib.suppress(OSError):
            load_path(path).unlink()
    return removed


def is_private_dir(directory: Path) -> bool:
    """True if `directory` is a real directory owned by this uid with no group/other access (so only this user, or
    root, can have created sockets in it)."""
    try:
        st = os.lstat(directory)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and (st.st_mode & 0o077) == 0


def ensure_private_dir(directory: Path) -> bool:
    """Creates `directory` (0700) if missing; True when it is private to this user (see `is_private_dir`)."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return False
    return is_private_dir(directory)


def usable_sockets(peer_id: str, directory: Path | None = None) -> list[Path]:
    """The paths where a server of this user with `peer_id` may be listening, sorted (a one-process server's
    socket, or one per handler process; which to try first is the client's choice: `local_transport.SocketTurns`);
    empty when there is none, the dir is one another user could write to, or a path is too long for a unix socket."""
    try:
        socket_path(peer_id, directory)
    except ValueError:
        return []
    directory = directory if directory is not None else socket_dir()
    if not is_private_dir(directory):
        return []
    usable = []
    for path in _peer_sockets(peer_id, directory):
        if len(os.fsencode(path)) > UNIX_PATH_MAX_BYTES:
            continue
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISSOCK(st.st_mode) and st.st_uid == os.getuid():
            usable.append(path)
    return usable


@dataclass(frozen=True)
class LocalHello:
    """The client's first frame: which rpc it opens and which server it expects behind the socket."""

    rpc: str
    peer_id: str
    version: int = LOCAL_STREAM_VERSION

    def to_bytes(self) -> bytes:
        return json.dumps({"version": self.version, "rpc": self.rpc, "peer_id": self.peer_id}).encode()

    @classmethod
    def from_bytes(cls, payload: bytes) -> LocalHello:
        try:
            data = json.loads(payload)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"local stream hello is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError("local stream hello must be a JSON object")
        rpc, peer_id, version = data.get("rpc"), data.get("peer_id"), data.get("version")
        if not isinstance(rpc, str) or not isinstance(peer_id, str) or not isinstance(version, int):
            raise ValueError("local stream hello needs string 'rpc', string 'peer_id' and integer 'version'")
        return cls(rpc=rpc, peer_id=peer_id, version=version)


def error_text(error: BaseException) -> bytes:
    """An ERROR frame's payload: `error`'s text (its repr where the text is empty) cut to `ERROR_TEXT_BYTES`, without
    the character the cut would split, so that no peer's error (whose text may quote what the caller sent) is sent
    whole, and a p2p one still fits a client's `MAX_ERROR_BYTES` once wrapped in its `RPCError`."""
    text = (str(error) or repr(error)).encode()
    if len(text) <= ERROR_TEXT_BYTES:
        return text
    return text[:ERROR_TEXT_BYTES].decode(errors="ignore").encode()


def header(kind: int, length: int) -> bytes:
    """The 5-byte header of a frame of `kind` whose payload is `length` bytes."""
    if kind not in FRAME_KINDS:
        raise ValueError(f"unknown frame kind {kind}")
    return _HEADER.pack(kind, length)


def frame(kind: int, payload: bytes = b"") -> list[bytes]:
    """One frame as buffers for `writer.writelines` (the payload is not copied)."""
    return [header(kind, len(payload)), payload]


def parse_header(buffer: bytes | bytearray, max_payload_bytes: int) -> tuple[int, int]:
    """(kind, payload length) from the first `HEADER_BYTES` of `buffer`; ValueError for an unknown kind or a
    payload over `max_payload_bytes`."""
    kind, length = _HEADER.unpack_from(buffer)
    if kind not in FRAME_KINDS:
        raise ValueError(f"unknown local stream frame kind {kind}")
    if length > max_payload_bytes:
        raise ValueError(f"local stream frame of {length} bytes exceeds the limit of {max_payload_bytes} bytes")
    return kind, length


async def read_frame(reader: asyncio.StreamReader, max_payload_bytes: int) -> tuple[int, bytes]:
    """The next (kind, payload). `asyncio.IncompleteReadError` at end of stream; ValueError (nothing more is read)
    for an unknown kind or a payload over `max_payload_bytes`."""
    kind, length = parse_header(await reader.readexactly(HEADER_BYTES), max_payload_bytes)
    payload = await reader.readexactly(length) if length else b""
    return kind, payload

"""Direct-port connections placed by load over the handler processes (`--num_handlers` N > 1): every process listens on
the one port (`SO_REUSEPORT`), where the kernel alone would spread connections at random (of 64 sessions the busiest
of 4 processes serves ~20). The process that accepted a connection looks up, before reading a byte of it, how many
each process serves (`LoadTable`) and sends the socket to a less loaded one (`ConnectionHandoff`: SCM_RIGHTS within
the device process's 0700 directory). The table, its locking and the descriptor checks: docs/contracts.md."""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import mmap
import os
import socket
import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from corolla.utils.logging import get_logger

logger = get_logger(__name__)

TABLE_NAME = "load"
SLOT = struct.Struct("=i")
MAX_PROCESSES = 1024
MAX_FDS_PER_MESSAGE = 4  # a hand-off sends one; anything more in a message is dropped
HANDOFF_MESSAGE = b"c"


def inbox_path(directory: Path, index: int) -> Path:
    """Where handler process `index` receives the connections handed to it."""
    return directory / f"in.{index}"


class LoadTable:
    """The open direct connections of every handler process (see the module docstring). `with` closes the mapping."""

    def __init__(self, path: Path):
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if size == 0 or size % SLOT.size or size // SLOT.size > MAX_PROCESSES:
                raise ValueError(f"load table {path}: {size} bytes is not 1-{MAX_PROCESSES} slots of {SLOT.size}")
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.num_slots = size // SLOT.size

    @classmethod
    def create(cls, path: Path, num_slots: int) -> LoadTable:
        """A new zeroed table of `num_slots` processes (mode 0600; an existing file is an error, never reused)."""
        if not 0 < num_slots <= MAX_PROCESSES:
            raise ValueError(f"a load table has 1-{MAX_PROCESSES} slots, got {num_slots}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, num_slots * SLOT.size)
        finally:
            os.close(fd)
        return cls(path)

    def __enter__(self) -> LoadTable:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            self._map.close()
            os.close(self._fd)
            self._fd = -1

    @contextlib.contextmanager
    def _locked(self) -> Iterator[list[int]]:
        """Every slot's count, written back when the block ends (all under the table's exclusive lock)."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            counts = [max(0, c) for (c,) in SLOT.iter_unpack(self._map)]
            before = list(counts)
            yield counts
            for i, (old, new) in enumerate(zip(before, counts, strict=True)):
                if new != old:
                    SLOT.pack_into(self._map, i * SLOT.size, max(0, new))
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def counts(self) -> list[int]:
        with self._locked() as counts:
            return list(counts)

    def place(self, own: int) -> int:
        """The process a connection accepted by `own` goes to (`own` unless another serves fewer; the first of the
        least loaded), counted there."""
        self.check_index(own)
        with self._locked() as counts:
            least = min(range(len(counts)), key=counts.__getitem__)
            target = own if counts[own] <= counts[least] else least
            counts[target] += 1
            return target

    def move(self, source: int, target: int) -> None:
        """A connection counted on `source` is served by `target` instead (a hand-off that could not be sent)."""
        self.check_index(source)
        self.check_index(target)
        with self._locked() as counts:
            counts[source] -= 1
            counts[target] += 1

    def release(self, index: int) -> None:
        """A connection of process `index` ended."""
        self.check_index(index)
        with self._locked() as counts:
            counts[index] -= 1

    def reset(self, index: int) -> None:
        """Process `index` starts with no connection (a replacement's predecessor's died with it)."""
        self.check_index(index)
        with self._locked() as counts:
            counts[index] = 0

    def check_index(self, index: int) -> None:
        """ValueError unless `index` names one of the table's processes."""
        if not 0 <= index < self.num_slots:
            raise ValueError(f"process index {index} outside the table's {self.num_slots} slots")


class BalanceDirectory:
    """The device process's private directory (0700) holding the load table of `num_processes` handler processes
    and their hand-off sockets; `with` (or `close`) removes it."""

    def __init__(self, num_processes: int):
        self._tmp = tempfile.TemporaryDirectory(prefix="corolla-direct-")
        self.path = Path(self._tmp.name)
        LoadTable.create(self.path / TABLE_NAME, num_processes).close()

    def __enter__(self) -> BalanceDirectory:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._tmp.cleanup()


class ConnectionHandoff:
    """Handler process `index`'s side: `place` keeps or sends away a connection it just accepted; `start` receives
    the ones other processes send here and gives each to `adopt`; `release` when a connection served here ends."""

    def __init__(self, directory: Path, index: int):
        self.directory = directory
        self.index = index
        self.table = LoadTable(directory / TABLE_NAME)
        self.table.check_index(index)
        self.sent = 0
        self.received = 0
        self._outbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._outbox.setblocking(False)
        self._inbox: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._adopt: Callable[[socket.socket], None] | None = None
        self._closed = False

    def start(self, adopt: Callable[[socket.socket], None]) -> None:
        """Receives hand-offs on this process's socket (replacing a predecessor's) from now on; zeroes its count."""
        path = inbox_path(self.directory, self.index)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        inbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            inbox.bind(str(path))
            os.chmod(path, 0o600)
            inbox.setblocking(False)
        except BaseException:
            inbox.close()
            raise
        self._inbox, self._adopt = inbox, adopt
        self.table.reset(self.index)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(inbox.fileno(), self._receive)

    def place(self, conn: socket.socket) -> bool:
        """True: serve `conn` here (counted here). False: it was handed to a less loaded process (closed here)."""
        target = self.table.place(self.index)
        if target == self.index:
            return True
        try:
            send_descriptors(self._outbox, inbox_path(self.directory, target), [conn.fileno()])
        except OSError as e:  # the target died or its queue is full: serve it here
            self.table.move(target, self.index)
            logger.debug(f"connection_balance.handoff_failed(target={target}, error={e!r})")
            return True
        conn.close()
        self.sent += 1
        return False

    def release(self) -> None:
        """A connection served here ended (nothing after `close`: the table went with the pool)."""
        if not self._closed:
            self.table.release(self.index)

    def _receive(self) -> None:
        inbox, adopt = self._inbox, self._adopt
        assert inbox is not None and adopt is not None
        while True:
            try:
                _, fds, _, _ = socket.recv_fds(inbox, 16, MAX_FDS_PER_MESSAGE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                logger.warning(f"connection_balance.receive_failed({e!r})")
                return
            for fd in fds:
                conn = _tcp_stream(fd)
                if conn is None:  # not from a sibling (theirs are accepted TCP sockets): no count of ours
                    continue
                self.received += 1
                adopt(conn)

    def stop_receiving(self) -> None:
        """No more hand-offs to this process (the first step of stopping; any still queued are closed)."""
        if self._inbox is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._inbox.fileno())
            self._inbox.close()
            self._inbox = None
            with contextlib.suppress(FileNotFoundError):
                inbox_path(self.directory, self.index).unlink()

    def close(self) -> None:
        """Stops receiving and unmaps the table (once the connections served here have ended). Idempotent."""
        self.stop_receiving()
        if not self._closed:
            self._closed = True
            self._outbox.close()
            self.table.close()


def send_descriptors(sock: socket.socket, path: Path, fds: list[int]) -> None:
    """One hand-off message carrying `fds` to the datagram socket at `path` (`socket.send_fds` of Python 3.11 drops
    its address argument)."""
    sock.sendmsg([HANDOFF_MESSAGE], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))], 0, str(path))


def _tcp_stream(fd: int) -> socket.socket | None:
    """A non-blocking socket object owning `fd` if it is a TCP stream socket; else None (the descriptor closed)."""
    try:
        conn = socket.socket(fileno=fd)
    except OSError:
        os.close(fd)
        return None
    if conn.type != socket.SOCK_STREAM or conn.family not in (socket.AF_INET, socket.AF_INET6):
        logger.warning(f"connection_balance.refused_descriptor(family={conn.family!r}, type={conn.type!r})")
        conn.close()
        return None
    conn.setblocking(False)
    return conn

"""What this client caught lying first-hand, kept so that its user can share it (`FindingStore`): one finding per
accused server outvoted 2:1 (by `client.session.shadows` or `client.verification.finding_check`), bounded in count
and bytes, in memory or in `ClientConfig.findings_dir` (`<peer id>.finding`, for anyone to re-check with
`corolla-findings`), and the peer ids caught (`liars`), which a client given the same directory bans again at start.
Only first-hand verdicts are written here: the store never reads findings to decide a ban."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from corolla.client.routing.findings import MAX_FINDING_BYTES, PEER_ID_PATTERN, Finding, encode_finding
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

FINDING_SUFFIX = ".finding"
LIARS_FILE = "liars"
MAX_LIARS = 4096  # peer ids kept across restarts; past it a liar is banned for this process only


@dataclass(frozen=True)
class StoredFinding:
    """One kept finding: its accused, its size, its file (None: kept in memory)."""

    peer_id: str
    num_bytes: int
    path: Path | None


class FindingStore:
    """Thread-safe (shadows record from the client loop, a user reads from anywhere). `directory` None: memory."""

    def __init__(self, directory: str | os.PathLike[str] | None, *, max_count: int, max_bytes: int):
        if max_count < 0 or max_bytes < 0:
            raise ValueError(f"findings' bounds must be >= 0, got {max_count} findings, {max_bytes} bytes")
        self.directory = None if directory is None else Path(directory)
        self.max_count, self.max_bytes = max_count, min(max_bytes, MAX_FINDING_BYTES)
        self._lock = threading.Lock()
        self._memory: dict[str, bytes] = {}  # no directory: accused -> bytes, oldest first
        self._liars: dict[str, None] = {}  # an ordered set
        self._written: dict[str, int] = {}  # files this store wrote -> order (ties of a coarse file clock)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._liars = dict.fromkeys(_read_liars(self.directory / LIARS_FILE))

    def liars(self) -> list[str]:
        """Peer ids caught first-hand by a client of this store (of earlier runs too, with a directory)."""
        with self._lock:
            return list(self._liars)

    def entries(self) -> list[StoredFinding]:
        """The findings kept, oldest first."""
        with self._lock:
            return self._entries()

    def read(self, peer_id: str) -> bytes | None:
        """The kept finding against `peer_id` (`findings.decode_finding` reads it), or None."""
        with self._lock:
            if self.directory is None:
                return self._memory.get(peer_id)
            entry = next((e for e in self._entries() if e.peer_id == peer_id), None)
            return None if entry is None or entry.path is None else entry.path.read_bytes()

    def record_caught(self, finding: Finding) -> StoredFinding | None:
        """Keeps `finding`, whose accused this client has just banned on first-hand evidence (outvoted 2:1), and
        its peer id among `liars`; returns what is kept (the first finding against that accused), or None where the
        finding alone is over the bound in bytes."""
        data = encode_finding(finding)
        peer_id = finding.peer_id
        with self._lock:
            self._remember_liar(peer_id)
            entries = self._entries()
            kept = next((e for e in entries if e.peer_id == peer_id), None)
            if kept is not None:
                return kept
            if len(data) > self.max_bytes or self.max_count == 0:
                logger.info(
                    "findings.not_kept(accused=...%s, bytes=%d): over the store's bound", peer_id[-6:], len(data)
                )
                return None
            total = sum(e.num_bytes for e in entries)
            while entries and (len(entries) + 1 > self.max_count or total + len(data) > self.max_bytes):
                oldest = entries.pop(0)
                total -= oldest.num_bytes
                self._drop(oldest)
            if self.directory is None:
                self._memory[peer_id] = data
                return StoredFinding(peer_id, len(data), None)
            path = self.directory / f"{peer_id}{FINDING_SUFFIX}"
            partial = self.directory / f".{peer_id}.partial"  # (a scan skips it: no suffix, leading dot)
            partial.write_bytes(data)
            os.replace(partial, path)
            self._written[peer_id] = len(self._written)
            logger.info("findings.kept(accused=...%s, path=%s, bytes=%d)", peer_id[-6:], path, len(data))
            return StoredFinding(peer_id, len(data), path)

    def _remember_liar(self, peer_id: str) -> None:
        if peer_id in self._liars:
            return
        if len(self._liars) >= MAX_LIARS:
            logger.info("findings.liars_full(accused=...%s): banned for this process only", peer_id[-6:])
            return
        self._liars[peer_id] = None
        if self.directory is not None:
            with open(self.directory / LIARS_FILE, "a") as file:
                file.write(peer_id + "\n")

    def _entries(self) -> list[StoredFinding]:
        if self.directory is None:
            return [StoredFinding(peer, len(data), None) for peer, data in self._memory.items()]
        found = []
        with os.scandir(self.directory) as scan:
            for item in scan:
                peer_id = item.name.removesuffix(FINDING_SUFFIX)
                if item.name.endswith(FINDING_SUFFIX) and PEER_ID_PATTERN.fullmatch(peer_id) and item.is_file():
                    stat = item.stat()
                    order = (stat.st_mtime_ns, self._written.get(peer_id, -1))
                    found.append((order, StoredFinding(peer_id, stat.st_size, Path(item.path))))
        return [entry for _, entry in sorted(found, key=lambda pair: pair[0])]

    def _drop(self, entry: StoredFinding) -> None:
        if entry.path is None:
            self._memory.pop(entry.peer_id, None)
        else:
            entry.path.unlink(missing_ok=True)
        logger.info("findings.dropped(accused=...%s): the store is full, the oldest goes", entry.peer_id[-6:])


def _read_liars(path: Path) -> list[str]:
    """The peer ids in `path` (at most `MAX_LIARS`; lines that are not peer ids are skipped); none if absent."""
    try:
        with open(path, "rb") as file:
            text = file.read(MAX_LIARS * 130).decode("ascii", errors="replace")
    except FileNotFoundError:
        return []
    lines = [line.strip() for line in text.splitlines()]
    return list(dict.fromkeys(line for line in lines if PEER_ID_PATTERN.fullmatch(line)))[:MAX_LIARS]

"""Graceful drain with KV hand-off, server side. `SessionHandoff` (one per front) reads whether the server is
draining from the core (`span_core.DrainState`): it refuses new sessions (every inference response then carries a
`DrainNotice`: `protocol.handoff.step_response`), streams a session's KV
cache to its own client on request (only while draining, once per session), and imports a cache sent by a client
into a new session (validated as hostile input). `drain_sessions` is the lifecycle step run on SIGTERM or before a
rebalance: announce OFFLINE, wait up to `drain_timeout_s` for open sessions to move, then let the server stop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Protocol

from hivemind.proto import runtime_pb2

from corolla.protocol import handoff as wire
from corolla.protocol.codecs import combine_parts, deserialize_tensor, serialize_tensor
from corolla.protocol.metadata import InferenceRequestMetadata, encode_metadata
from corolla.protocol.records import ServerState
from corolla.server.announcer import Announcer
from corolla.server.core import kv_handoff as kv
from corolla.server.core.admission import SessionTicket
from corolla.server.core.executor import SessionCache
from corolla.server.core.span_core import CoreClient, DrainState
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

DRAIN_POLL_S = 0.02
__all__ = ["SessionHandoff", "drain_sessions"]


class HandoffSession(Protocol):
    """What the hand-off reads and moves of a front's session (`front.inference_stream.SessionState`)."""

    session_id: str | None
    block_indices: list[int]
    batch_size: int
    max_length: int
    cache: SessionCache | None
    prefix_length: int
    ticket: SessionTicket | None


class SessionHandoff:
    """A front's view of the drain (the core's `DrainState`) and the two hand-off operations (export, import) on its
    sessions."""

    def __init__(self, core: CoreClient, request_timeout_s: float, *, enabled: bool = True):
        self.core = core  # the sessions' caches: read and written through the one seam
        self.request_timeout_s = request_timeout_s  # an import's part messages must all arrive within this
        self.enabled = enabled  # --no_kv_handoff: neither export nor import (draining still refuses new sessions)
        self.drain: DrainState = core.drain  # the core's: started by `drain_sessions`
        self.num_exported = 0
        self.num_imported = 0
        self._exported: set[int] = set()  # id() of sessions already exported (no new sessions while draining)

    # ---- hooks called by the handler

    def check_accepting(self) -> None:
        """Raises `Draining` (the handler counts it as a refusal) when the server takes no new sessions."""
        self.drain.check_accepting()

    def import_header(self, metadata: InferenceRequestMetadata) -> wire.KvHeader | None:
        """The `KvHeader` of a session opened with an imported cache, None for a plain session; ValueError if bad."""
        raw = metadata.extra.get(wire.IMPORT_KEY)
        if raw is None:
            return None
        if not self.enabled:
            raise ValueError("this server does not accept KV imports (--no_kv_handoff)")
        return wire.KvHeader.from_dict(raw)

    # ---- export (draining server -> its own client, on the session's stream)

    async def export(self, session: HandoffSession) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """The header message, then the part messages of the session's cache; one error message if it can't."""
        started = time.perf_counter()
        try:
            header, messages = await self._export_messages(session)
        except Exception as e:  # unsupported, not draining, runtime gone: the client replays instead
            logger.info(f"handoff.export_refused(session_id={session.session_id!r:.40}): {e}")
            yield runtime_pb2.ExpertResponse(metadata=encode_metadata({wire.KV_HEADER_KEY: {"error": str(e)}}))
            return
        yield runtime_pb2.ExpertResponse(metadata=encode_metadata({wire.KV_HEADER_KEY: header.to_dict()}))
        for parts in messages:
            yield runtime_pb2.ExpertResponse(tensors=parts)
        self.num_exported += 1
        logger.info(
            f"handoff.exported(session_id={session.session_id!r:.40}, position={header.position}, "
            f"bytes={header.total_bytes}, messages={header.num_messages}, "
            f"seconds={time.perf_counter() - started:.4f})"
        )

    async def _export_messages(self, session: HandoffSession) -> tuple[wire.KvHeader, list[list[runtime_pb2.Tensor]]]:
        if not self.enabled:
            raise kv.HandoffUnsupported("KV hand-off is disabled on this server (--no_kv_handoff)")
        if not self.drain.draining:
            raise ValueError("a session's KV cache is exported only while the server drains")
        if id(session) in self._exported:
            raise ValueError("this session's KV cache was already exported")
        position = session.prefix_length
        if position < 1 or session.cache is None:
            raise ValueError("the session holds no tokens to export")
        self.core.handoff_layout(session.cache.spec)  # HandoffUnsupported: the client replays
        self._exported.add(id(session))
        tensors = await self.core.read_kv(session.cache, position)
        messages = wire.pack_messages(serialize_tensor(t) for t in tensors)
        header = wire.KvHeader(
            position=position,
            batch_size=session.batch_size,
            start_block=session.block_indices[0],
            end_block=session.block_indices[-1] + 1,
            num_messages=len(messages),
            total_bytes=sum(wire.message_bytes(m) for m in messages),
        )
        return header, messages

    # ---- import (client -> replacement server, first messages of a new stream)

    async def import_kv(
        self,
        session: HandoffSession,
        header: wire.KvHeader,
        uid: str,
        requests: AsyncIterator[runtime_pb2.ExpertRequest],
    ) -> None:
        """Reads `header.num_messages` part messages from the stream, validates them against this session's own
        cache layout (exact bytes, shapes, dtypes, finite values) and writes them; the session then starts at
        `header.position`. ValueError (nothing written) on any mismatch or past `request_timeout_s`."""
        started = time.perf_counter()
        blocks = session.block_indices
        if (header.batch_size, header.start_block, header.end_block) != (session.batch_size, blocks[0], blocks[-1] + 1):
            raise ValueError(
                f"KV import is for batch {header.batch_size}, blocks {header.start_block}:{header.end_block}; "
                f"this session has batch {session.batch_size}, blocks {blocks[0]}:{blocks[-1] + 1}"
            )
        if header.position > session.max_length:
            raise ValueError(
                f"KV import of {header.position} tokens exceeds the session's max_length {session.max_length}"
            )
        if session.cache is None:
            raise ValueError("a KV import needs a session with max_length > 0")
        descriptors = self.core.handoff_layout(session.cache.spec)  # HandoffUnsupported: the client replays
        expected = kv.canonical_nbytes(descriptors, header.position)
        if header.total_bytes != expected:
            raise ValueError(f"KV import announces {header.total_bytes} bytes; {header.position} tokens are {expected}")
        parts = await self._read_parts(header, uid, requests, expected)
        tensors = [deserialize_tensor(t) for t in combine_parts(parts)]
        del parts
        kv.validate_import(tensors, descriptors, header.position)
        await self.core.write_kv(session.cache, tensors, header.position)
        session.prefix_length = header.position
        if session.ticket is not None:  # the imported positions are real work (done on the old server)
            session.ticket.touch(header.position * session.batch_size)
        self.num_imported += 1
        logger.info(
            f"handoff.imported(session_id={session.session_id!r:.40}, blocks={blocks[0]}:{blocks[-1] + 1}, "
            f"position={header.position}, bytes={expected}, seconds={time.perf_counter() - started:.4f})"
        )

    async def _read_parts(
        self, header: wire.KvHeader, uid: str, requests: AsyncIterator[runtime_pb2.ExpertRequest], expected: int
    ) -> list[runtime_pb2.Tensor]:
        timeout_s = self.request_timeout_s
        deadline = time.monotonic() + timeout_s
        parts: list[runtime_pb2.Tensor] = []
        received = 0
        for _ in range(header.num_messages):
            try:
                message = await asyncio.wait_for(requests.__anext__(), max(deadline - time.monotonic(), 0.001))
            except StopAsyncIteration:
                raise ValueError(f"KV import ended after {received} of {expected} bytes") from None
            except asyncio.TimeoutError:
                raise ValueError(f"KV import not complete within request_timeout={timeout_s} s") from None
            if message.uid != uid:
                raise ValueError("KV import messages must carry the session's uid")
            received += wire.message_bytes(message.tensors)
            if received > expected:
                raise ValueError(f"KV import sent more than the {expected} bytes it announced")
            parts.extend(message.tensors)
        if received != expected:
            raise ValueError(f"KV import sent {received} bytes, announced {expected}")
        return parts


async def drain_sessions(core: CoreClient, announcer: Announcer, timeout_s: float) -> None:
    """Starts the core's drain (every front refuses new sessions and offers its sessions' KV to their clients) and
    announces OFFLINE (so no client plans new sessions here) while waiting up to `timeout_s` for the sessions open
    through any front to move away; then returns, and the caller ends whatever is left."""
    started = time.monotonic()
    core.drain.start(timeout_s)
    num_open = core.num_open
    logger.info(f"drain.start(sessions={num_open}, timeout_s={timeout_s})")
    offline = asyncio.ensure_future(announcer.announce(ServerState.OFFLINE))
    while core.num_open > 0 and time.monotonic() - started < timeout_s:
        await asyncio.sleep(DRAIN_POLL_S)
    await offline
    logger.info(
        f"drain.done(sessions_at_start={num_open}, left={core.num_open}, seconds={time.monotonic() - started:.2f})"
    )

"""`LocalEndpoint`: serves `rpc_inference` to corolla clients on the same machine over a unix socket (framing:
`protocol.local_stream`), through the same handler method as the p2p stream, without the two p2pd daemons. With
handler processes each listens on its own socket and writes its connection count into a load file beside it
(`local_stream.StreamLoad`), which clients read to pick the less loaded of two sockets."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from pathlib import Path

from hivemind.p2p import P2PContext, PeerID

from corolla.protocol import local_stream as ls
from corolla.server.core.limits import MessagePace
from corolla.server.front.stream_endpoint import (
    AcceptedStream,
    Connections,
    FrameConnection,
    PlainFrames,
    StreamRpcs,
    check_hello,
    read_hello,
    serve_connection,
)
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


class LocalEndpoint:
    """A unix-socket listener for the handler of one span; `start()` returns False (and serves nothing) where the
    socket dir is not private to this user or the path does not fit a unix socket."""

    def __init__(
        self,
        handler: StreamRpcs,
        peer_id: PeerID,
        *,
        directory: Path | None = None,
        index: int | None = None,
        pace: MessagePace | None = None,
    ):
        self.handler = handler
        self.pace = pace  # the minimum rate of a message in flight, both ways (`PeerLimits.message_pace`)
        self.index = index  # handler process index (its own socket), None: the server's one socket
        self.peer_id = peer_id  # hivemind PeerID (handed to the handler as the context's local id)
        self.peer_id_b58 = peer_id.to_base58()
        self.directory = directory if directory is not None else ls.socket_dir()
        self.path: Path | None = None
        self.max_frame_bytes = int(handler.max_stream_bytes) + (1 << 20)
        self.streams_opened = 0
        self.connections = Connections()  # (each one's task runs `stream_endpoint.serve_connection`)
        self._load: ls.StreamLoad | None = None  # a handler process's load file (clients pick the less loaded)

    @property
    def num_open(self) -> int:
        return self.connections.num_open

    async def start(self) -> bool:
        if not ls.ensure_private_dir(self.directory):
            logger.warning(f"local_endpoint.disabled(dir={self.directory}): not a directory private to this user")
            return False
        path = ls.socket_path(self.peer_id_b58, self.directory, self.index)
        if len(os.fsencode(path)) > ls.UNIX_PATH_MAX_BYTES:
            logger.warning(f"local_endpoint.disabled(path={path}): longer than a unix socket path may be")
            return False
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a socket left by an earlier run with the same identity
        serve = functools.partial(serve_connection, self)
        self.connections.server = await asyncio.get_running_loop().create_unix_server(
            lambda: FrameConnection(serve=serve), path=str(path)
        )
        os.chmod(path, 0o600)
        self.path = path
        if self.index is not None:  # one of several handler processes' sockets
            try:
                self._load = ls.StreamLoad(path).open()
            except OSError as e:  # clients then pick without it
                logger.warning(f"local_endpoint.no_load_file(path={path}): {e!r}")
        logger.info(f"local_endpoint.listening(path={path})")
        return True

    async def stop(self) -> None:
        """Stops accepting, ends open streams (their sessions free their caches) and removes the socket."""
        await self.connections.close()
        if self._load is not None:
            self._load.close()
            self._load = None
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            self.path = None

    def _report_load(self) -> None:
        if self._load is not None:
            try:
                self._load.write(self.connections.num_open)
            except OSError as e:  # clients then pick without it
                logger.debug(f"local_endpoint.load_unwritten({e!r})")

    async def accept(self, conn: FrameConnection) -> AcceptedStream | None:
        """The connection's hello checked and answered (`stream_endpoint.StreamListener`)."""
        self._report_load()
        try:
            hello = ls.LocalHello.from_bytes(await read_hello(conn))
            check_hello(
                "local stream", version=hello.version, expected_version=ls.LOCAL_STREAM_VERSION,
                peer_id=hello.peer_id, own_peer_id=self.peer_id_b58, rpc=hello.rpc,
            )  # fmt: skip
        except asyncio.TimeoutError:
            logger.info("local_endpoint.rejected(reason=no_hello)")
            return None
        except ValueError as e:
            logger.info(f"local_endpoint.rejected(reason=bad_hello): {e}")
            conn.writelines(ls.frame(ls.ERROR, ls.error_text(e)))
            return None
        conn.writelines(ls.frame(ls.ACCEPT))
        self.streams_opened += 1
        context = P2PContext(handle_name=hello.rpc, local_id=self.peer_id, remote_id=None)
        return AcceptedStream(context, PlainFrames(), pace=self.pace)

    def ended(self, accepted: AcceptedStream | None) -> None:
        self._report_load()

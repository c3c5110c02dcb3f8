"""The RPC service Petals peers call: `TransformerConnectionHandler` with its seven `rpc_*` handlers, handle names
`"TransformerConnectionHandler.rpc_<name>"`, message types from the type hints (hivemind resolves them with
`typing.get_type_hints`: the server's subclass imports the hinted names at module level). Clients use
`get_stub(p2p, peer_id)`."""

from __future__ import annotations

import collections.abc
import threading
import typing
from collections.abc import AsyncIterator

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase, StubBase
from hivemind.proto import runtime_pb2

SERVICE_NAME = "TransformerConnectionHandler"


def handle_name(method_name: str) -> str:
    """`"rpc_info" -> "TransformerConnectionHandler.rpc_info"` (no namespace, as Petals)."""
    return f"{SERVICE_NAME}.{method_name}"


_HANDLER_TABLES = threading.Lock()  # held while a servicer class fills its table of rpcs


class TransformerConnectionHandler(ServicerBase):
    """Declares the service's signatures; bodies raise NotImplementedError (the server overrides them).

    Unlike plain hivemind servicers, every subclass collects its own handlers (so a subclass may add `rpc_*`
    extensions) and registers under `SERVICE_NAME`. hivemind publishes a class's table before filling it, without a
    lock (servers started at once in one process left rpcs unregistered): here it is filled under a lock, and counts
    as filled only once its stub type, set last, exists."""

    @classmethod
    def _collect_rpc_handlers(cls) -> None:
        if cls.__dict__.get("_stub_type") is not None:
            return
        with _HANDLER_TABLES:
            if cls.__dict__.get("_stub_type") is None:
                cls._rpc_handlers = None  # never a parent's table (hivemind caches on the class) or a half-filled one
                cls._stub_type = None
                super()._collect_rpc_handlers()

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        name = handle_name(method_name)
        return name if namespace is None else f"{namespace}::{name}"

    @staticmethod
    def _strip_iterator_hint(hint: type) -> tuple[type, bool]:
        # hivemind only recognizes `typing.AsyncIterator[...]`; accept `collections.abc` generics too.
        if typing.get_origin(hint) in (collections.abc.AsyncIterator, collections.abc.AsyncIterable):
            return typing.get_args(hint)[0], True
        return hint, False

    @classmethod
    def handle_names(cls) -> dict[str, bool]:
        """`{handle name: is_stream}` for every rpc this class serves."""
        cls._collect_rpc_handlers()
        return {
            cls._get_handle_name(None, h.method_name): (h.stream_input or h.stream_output) for h in cls._rpc_handlers
        }

    async def rpc_inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Bidirectional stream: one session, one request/response per step (KV cache kept between steps)."""
        raise NotImplementedError
        yield  # makes this an async generator, like the overrides

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        raise NotImplementedError

    async def rpc_forward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError
        yield

    async def rpc_backward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        raise NotImplementedError

    async def rpc_backward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError
        yield

    async def rpc_push(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """Server-to-server push of a step's outputs to the next server of the chain."""
        raise NotImplementedError

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        """Returns msgpack-serialized server info (schemas, limits) in `ExpertInfo.serialized_info`."""
        raise NotImplementedError


def get_stub(p2p: P2P, peer_id: PeerID) -> StubBase:
    """A stub whose `rpc_*` coroutines call `peer_id`; stream-output calls take no timeout (wrap with wait_for)."""
    return TransformerConnectionHandler.get_stub(p2p, peer_id)

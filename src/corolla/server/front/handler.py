"""The RPC service (transport only): `TransformerConnectionHandler` with the seven Petals rpcs on a P2P replica of the
DHT's daemon, in the front's one asyncio loop: it validates every request once (`block_functions`), hands typed records
to the core through its one seam and counts refusals. Its inference streams are `inference_stream`'s; here the unary
and gathered rpcs (a `*_stream` request read whole, bounded in messages, size and time) and the wiring."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import torch
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.tensor_descr import BatchTensorDescriptor

from corolla import PETALS_COMPAT_VERSION
from corolla.protocol import rpc
from corolla.protocol.codecs import MAX_UNARY_PAYLOAD_BYTES, combine_parts, stream_messages
from corolla.protocol.metadata import ForwardRequestMetadata, InferenceRequestMetadata, encode_metadata
from corolla.server.core.limits import PeerLimits, SessionTimeouts, peer_key
from corolla.server.core.peer_bytes import LentStreamBudget, StreamBudget, StreamLender
from corolla.server.core.refusals import BadRequest, RequestTimeout
from corolla.server.core.span_core import CoreClient
from corolla.server.front import block_functions as bf
from corolla.server.front.block_functions import ServingLimits
from corolla.server.front.direct_endpoint import DirectTicketRpc
from corolla.server.front.inference_stream import InferenceStreams, SessionHandoff, SessionRegistry
from corolla.server.front.peer_auth import PeerAuth, check_request, gate_stream, info_uid, remote_peer
from corolla.server.front.prefix_keys import PrefixTrust
from corolla.server.front.stream_guard import register_handlers
from corolla.server.metrics import ServerMetrics
from corolla.swarm.membership import MembershipError
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

_T = TypeVar("_T")
# a unary or gathered-stream RPC's work: (uid, tensors, raw metadata, peer key) -> its output records
_Compute = Callable[[str, list[torch.Tensor], bytes, str], Awaitable[list[runtime_pb2.Tensor]]]


MAX_STREAM_MESSAGES = 4096


async def gather_stream(
    requests: AsyncIterator[runtime_pb2.ExpertRequest], *, request_timeout_s: float, max_stream_bytes: int
) -> tuple[str, list[runtime_pb2.Tensor], bytes]:
    """uid, combined serialized tensors and metadata of a stream request; the uid must be equal in all parts."""
    uid: str | None = None
    metadata = b""
    parts: list[runtime_pb2.Tensor] = []
    total_bytes = 0
    deadline = time.monotonic() + request_timeout_s
    iterator = requests.__aiter__()
    for count in range(MAX_STREAM_MESSAGES + 1):
        remaining = deadline - time.monotonic()
        try:
            message = await asyncio.wait_for(iterator.__anext__(), max(remaining, 0.001))
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise ValueError(f"stream request not complete within request_timeout={request_timeout_s} s") from None
        if count == MAX_STREAM_MESSAGES:
            raise ValueError(f"stream request has more than {MAX_STREAM_MESSAGES} messages")
        if uid is None:
            uid, metadata = message.uid, message.metadata
        elif message.uid != uid:
            raise ValueError("all messages of a stream request must carry the same uid")
        total_bytes += sum(len(t.buffer) for t in message.tensors)
        if total_bytes > max_stream_bytes:
            raise ValueError(f"stream request is larger than the limit of {max_stream_bytes} bytes")
        parts.extend(message.tensors)
    if uid is None:
        raise ValueError("stream request is empty: expected at least one message with uid and tensors")
    return uid, combine_parts(parts), metadata


class TransformerConnectionHandler(InferenceStreams, DirectTicketRpc, rpc.TransformerConnectionHandler):
    """Serves one span of blocks. Same class name as Petals', so handle names match."""

    def __init__(
        self,
        *,
        limits: ServingLimits,
        core: CoreClient,
        timeouts: SessionTimeouts,
        compression: int = runtime_pb2.CompressionType.NONE,
        dht_client_mode: bool = False,
        metrics: ServerMetrics | None = None,
        peer_limits: PeerLimits | None = None,
        peer_auth: PeerAuth | None = None,
        stream_lender: StreamLender | None = None,
    ):
        self.limits = limits
        self.stream_lender = stream_lender  # a handler process's: its stream bytes are lent by the core
        self.peer_auth = peer_auth  # private swarm: every RPC proves membership (server.peer_auth); None = open
        self.core = core  # the one seam to the core: in this process (`SpanCore`) or over a socket (`RemoteCore`)
        self.metrics = metrics if metrics is not None else ServerMetrics()
        # drain (the core's state): refuses new sessions, moves KV
        self.handoff = SessionHandoff(core, timeouts.request_timeout_s)
        self.configure_limits(peer_limits if peer_limits is not None else PeerLimits())
        self.timeouts = timeouts
        self.compression = compression
        self.dht_client_mode = dht_client_mode
        self.sessions = SessionRegistry()  # this front's streams
        self.prefix_trust = PrefixTrust()  # whose cached prefixes a session reuses (the operator may share them all)
        self.p2p: P2P | None = None
        self._push_tasks: set[asyncio.Task] = set()
        self._pushes_in_flight: dict[str, int] = {}
        self.cache_bytes_per_token_block = max(1, core.cache_bytes_per_token((limits.start_block,)))
        self.max_stream_bytes = limits.max_stream_bytes

    def configure_limits(self, peer_limits: PeerLimits) -> None:
        """Sets this front's fair-use limits (before serving): its stream bytes, and the forwards' chunks (the core's
        own, sessions, forward slots and KV imports in flight, are set on the core: `SpanCore.configure`)."""
        self.peer_limits = peer_limits
        stream_limits = peer_limits.with_stream_defaults(self.limits.step_bytes)
        if self.stream_lender is None:  # unfinished streamed bytes: the one front's, or what the core lent this process
            self.stream_budget = StreamBudget(stream_limits)
        else:
            self.stream_budget = LentStreamBudget(stream_limits, self.stream_lender)

    # ---- registration ---------------------------------------------------------------------------------------------

    async def add_p2p_handlers(self, p2p: P2P, *args: Any, balanced: bool = False, **kwargs: Any) -> None:
        """`balanced`: p2pd spreads streams over every process that registered (handler processes)."""
        self.p2p = p2p
        await register_handlers(self, p2p, self.stream_budget, self._reject, balanced=balanced)  # bounded reads

    async def shutdown(self) -> None:
        """Ends all sessions (freeing their caches) and outstanding pushes."""
        await self.sessions.close_all()
        for task in list(self._push_tasks):
            task.cancel()

    # ---- helpers --------------------------------------------------------------------------------------------------

    @property
    def cache_tokens_available(self) -> int:
        """KV cache left in (token x block) units: a session of max_length over k blocks takes k * max_length."""
        return max(0, self.core.bytes_left // self.cache_bytes_per_token_block)

    @staticmethod
    def _check_unary_size(response: runtime_pb2.ExpertResponse, rpc_name: str) -> runtime_pb2.ExpertResponse:
        size = sum(len(t.buffer) for t in response.tensors)
        if size > MAX_UNARY_PAYLOAD_BYTES:
            raise ValueError(
                f"response of {size} bytes exceeds the unary limit of {MAX_UNARY_PAYLOAD_BYTES} bytes; "
                f"call {rpc_name}_stream for large tensors"
            )
        return response

    def _output_compressions(self, metadata: ForwardRequestMetadata, count: int) -> list[int]:
        if metadata.output_compression is None:
            return [self.compression] * count
        if len(metadata.output_compression) != count:
            raise BadRequest(
                f"output_compression must have {count} entries (one per output tensor), "
                f"got {len(metadata.output_compression)}"
            )
        return list(metadata.output_compression)

    # ---- forward / backward ---------------------------------------------------------------------------------------

    async def _forward(
        self, uid: str, tensors: list[torch.Tensor], raw_metadata: bytes, peer: str
    ) -> list[runtime_pb2.Tensor]:
        block_indices = bf.resolve_chain(uid, self.limits)
        metadata = ForwardRequestMetadata.from_bytes(raw_metadata)
        adapter = bf.validate_adapter(metadata.active_adapter, self.limits)
        compressions = self._output_compressions(metadata, 1)
        args = bf.unpack_request_args(tensors, metadata.args_structure)
        inputs = bf.parse_forward_inputs(args, self.limits, num_blocks=len(block_indices), adapter=adapter)
        outputs = await self.core.forward(
            peer, tuple(block_indices), inputs, chunk_tokens=self.peer_limits.forward_chunk_tokens,
            timeout_s=self.timeouts.request_timeout_s,
        )  # fmt: skip
        return [self._serialize_output(outputs, compressions[0])]

    async def _backward(
        self, uid: str, tensors: list[torch.Tensor], raw_metadata: bytes, peer: str
    ) -> list[runtime_pb2.Tensor]:
        block_indices = bf.resolve_chain(uid, self.limits)
        metadata = ForwardRequestMetadata.from_bytes(raw_metadata)
        adapter = bf.validate_adapter(metadata.active_adapter, self.limits)
        args = bf.unpack_request_args(tensors, metadata.args_structure)
        inputs = bf.parse_backward_inputs(args, self.limits, num_blocks=len(block_indices), adapter=adapter)
        compressions = self._output_compressions(metadata, 2 if inputs.has_prompts else 1)
        grads = await self.core.backward(peer, tuple(block_indices), inputs, timeout_s=self.timeouts.request_timeout_s)
        return [self._serialize_output(g, c) for g, c in zip(grads, compressions, strict=True)]

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return await self._unary("rpc_forward", self._forward, request, context)

    def rpc_forward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        return self._streamed("rpc_forward_stream", self._forward, requests, context)

    async def rpc_backward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return await self._unary("rpc_backward", self._backward, request, context)

    def rpc_backward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        return self._streamed("rpc_backward_stream", self._backward, requests, context)

    async def _unary(
        self, name: str, compute: _Compute, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        """A unary rpc: its request checked and computed, its reply within the unary size limit."""
        check_request(self.peer_auth, name, context, request)

        async def run() -> list[runtime_pb2.Tensor]:
            tensors = bf.deserialize_request(request.tensors)
            return await compute(request.uid, tensors, request.metadata, peer_key(context))

        outputs = await self._run_logged(name, run())
        return self._check_unary_size(runtime_pb2.ExpertResponse(tensors=outputs), name)

    async def _streamed(
        self, name: str, compute: _Compute, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """A streamed rpc: its request gathered whole and computed, its reply split into stream messages."""
        requests = gate_stream(self.peer_auth, name, requests, context)

        async def run() -> list[runtime_pb2.Tensor]:
            uid, serialized, metadata = await gather_stream(
                requests, request_timeout_s=self.timeouts.request_timeout_s, max_stream_bytes=self.max_stream_bytes
            )
            return await compute(uid, bf.deserialize_request(serialized), metadata, peer_key(context))

        # the reply split into stream messages of at most `STREAM_CHUNK_BYTES` each
        for response in stream_messages(runtime_pb2.ExpertResponse, await self._run_logged(name, run())):
            yield response

    async def _run_logged(self, name: str, coro: Awaitable[_T]) -> _T:
        try:
            return await coro
        except asyncio.TimeoutError:
            error = RequestTimeout(f"{name} did not finish within request_timeout={self.timeouts.request_timeout_s} s")
            self._reject(name, error)
            raise error from None
        except MembershipError:
            raise  # counted as not_member by peer_auth
        except Exception as e:
            self._reject(name, e)
            raise

    # ---- info -----------------------------------------------------------------------------------------------------

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        uid = info_uid(self.peer_auth, context, request.uid)  # private swarm: members append a proof to the uid
        info: dict[str, Any] = {
            "version": PETALS_COMPAT_VERSION,
            "dht_client_mode": self.dht_client_mode,
            "cache_tokens_available": self.cache_tokens_available,
            "serving_path": self.core.path,  # corolla's: fused or eager (Petals clients ignore extra keys)
        }
        if uid:
            bf.resolve_chain(uid, self.limits)
            hidden = BatchTensorDescriptor(
                1, 2048, self.limits.hidden_size, dtype=self.limits.dtype, compression=self.compression
            )
            info["forward_schema"] = ((hidden,), {})
            info["outputs_schema"] = (hidden,)
            info["keyword_names"] = ()
            info["inference_schema"] = (
                (
                    hidden,
                    BatchTensorDescriptor((), dtype=self.limits.dtype),
                    BatchTensorDescriptor((), dtype=torch.int64),
                ),
                {},
            )
        return runtime_pb2.ExpertInfo(serialized_info=MSGPackSerializer.dumps(info))

    # ---- push -----------------------------------------------------------------------------------------------------

    async def rpc_push(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        check_request(self.peer_auth, "rpc_push", context, request)
        metadata = InferenceRequestMetadata.from_bytes(request.metadata)
        if metadata.session_id is None:
            raise BadRequest("rpc_push requires metadata['session_id']")
        # `pushed` is ours to set: a step that came by push never passes for one the session's client sent
        pushed = runtime_pb2.ExpertRequest(
            uid=request.uid, tensors=request.tensors, metadata=encode_metadata({**metadata.to_dict(), "pushed": True})
        )
        if not self.core.push(metadata.session_id, pushed, sender=remote_peer(context)):
            # the same empty answer either way: the pusher learns nothing about which sessions exist
            logger.debug(f"rpc_push.ignored(session_id={metadata.session_id!r:.40}): unknown, not upstream or full")
        return runtime_pb2.ExpertResponse()

"""The RPC service (transport only): `TransformerConnectionHandler` with the seven Petals rpcs on a P2P replica of the
DHT's daemon, all in the front's one asyncio loop. It decodes messages and metadata, validates them once
(`block_functions`), hands the typed records to the core through its one seam (`core`, a `span_core.CoreClient`:
sessions, steps, forwards, pushes, the drain), keeps only its own streams (`sessions`), pushes steps to the next
server, encodes replies and counts refusals (`refusals`)."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import torch
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.tensor_descr import BatchTensorDescriptor

from corolla import PETALS_COMPAT_VERSION
from corolla.protocol import handoff as hw
from corolla.protocol import rpc
from corolla.protocol.codecs import MAX_UNARY_PAYLOAD_BYTES, serialize_tensor
from corolla.protocol.metadata import (
    ForwardRequestMetadata,
    InferenceRequestMetadata,
    decode_metadata,
    encode_metadata,
)
from corolla.protocol.prefix import PREFIX_KEY
from corolla.protocol.shadow import parse_shadow
from corolla.protocol.uids import make_chain
from corolla.server.core.drain import SessionHandoff
from corolla.server.core.executor import SessionSpec
from corolla.server.core.limits import PeerLimits, peer_key
from corolla.server.core.push_guard import SessionPushGuard, mark_pushed_reply
from corolla.server.core.refusals import BadRequest, Draining, RequestTimeout, rejection_reason
from corolla.server.core.sessions import PushInbox, SessionRegistry, SessionState, SessionTimeouts, iterate_steps
from corolla.server.core.span_core import CoreClient
from corolla.server.front import block_functions as bf
from corolla.server.front.block_functions import ServingLimits
from corolla.server.front.direct_endpoint import DirectTicketRpc
from corolla.server.front.peer_auth import PeerAuth, check_request, gate_stream, info_uid, remote_peer
from corolla.server.front.prefix_keys import PrefixTrust, client_keys, probe_keys, with_hit
from corolla.server.front.stream_guard import StreamBudget, register_handlers
from corolla.server.front.stream_requests import gather_stream, stream_response
from corolla.server.metrics import ServerMetrics
from corolla.swarm.membership import MembershipError
from corolla.utils.deadlines import TaskDeadline
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

_timeout = getattr(asyncio, "timeout", None)  # Python >= 3.11
_T = TypeVar("_T")
# a unary or gathered-stream RPC's work: (uid, tensors, raw metadata, peer key) -> its output records
_Compute = Callable[[str, list[torch.Tensor], bytes, str], Awaitable[list[runtime_pb2.Tensor]]]


async def _await_within(coro: Awaitable[_T], timeout_s: float) -> _T:
    """`await coro` with a deadline (TimeoutError past it). On Python >= 3.11 without the task of its own and the
    extra loop iterations that `asyncio.wait_for` costs each step."""
    if _timeout is None:
        return await asyncio.wait_for(coro, timeout_s)
    async with _timeout(timeout_s):
        return await coro


def _opening_tokens(first: runtime_pb2.ExpertRequest) -> int:
    """Tokens the opening request of a session brings: its hidden states' length `[B, T, H]` (0 for none)."""
    size = list(first.tensors[0].size) if first.tensors else []
    return int(size[1]) if len(size) == 3 else 0


class TransformerConnectionHandler(DirectTicketRpc, rpc.TransformerConnectionHandler):
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
    ):
        self.limits = limits
        self.peer_auth = peer_auth  # private swarm: every RPC proves membership (server.peer_auth); None = open
        self.core = core  # the one seam to the core: in this process (`SpanCore`) or over a socket (`RemoteCore`)
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self.configure_limits(peer_limits if peer_limits is not None else PeerLimits())
        self.timeouts = timeouts
        self.compression = compression
        self.dht_client_mode = dht_client_mode
        self.sessions = SessionRegistry()  # this front's streams
        # drain (the core's state): refuses new sessions, moves KV
        self.handoff = SessionHandoff(core, timeouts.request_timeout_s)
        self.prefix_trust = PrefixTrust()  # whose cached prefixes a session reuses (the operator may share them all)
        self.p2p: P2P | None = None
        self._push_tasks: set[asyncio.Task] = set()
        self.cache_bytes_per_token_block = max(1, core.cache_bytes_per_token((limits.start_block,)))
        self.max_stream_bytes = 4 * limits.max_batch_size_tokens * limits.hidden_size * 8 + (1 << 20)

    def configure_limits(self, peer_limits: PeerLimits) -> None:
        """Sets this front's fair-use limits (before serving): its stream bytes, and the forwards' chunks (the core's
        own, sessions and forward slots, are set on the core: `SpanCore.configure`)."""
        self.peer_limits = peer_limits
        step_bytes = self.limits.max_batch_size_tokens * self.limits.hidden_size * 4  # one step in float32
        self.stream_budget = StreamBudget(peer_limits.with_stream_defaults(step_bytes))  # unfinished streamed bytes

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

    def _report_cache(self) -> None:
        left = self.core.bytes_left
        self.metrics.set_cache(max(0, self.core.max_size_bytes - left), left)
        stats = self.core.prefix_cache_stats()
        self.metrics.set_prefix_cache(stats.cached_bytes, stats.evictions, stats.limit_bytes)

    def _record_prefix_keys(self, session: SessionState, namespace: str, metadata: InferenceRequestMetadata) -> None:
        """Keys on a request of the session's own client (never a pushed one): its pages are published once
        computed, for later sessions of `namespace`. A client names a block's keys once, with the step that completes
        it: most decode steps carry none and never reach the trust rule."""
        if PREFIX_KEY not in metadata.extra:
            return
        keys = client_keys(metadata)
        if keys is not None and session.cache is not None:
            self.core.add_prefix_keys(session.cache, namespace, keys)

    @property
    def cache_tokens_available(self) -> int:
        """KV cache left in (token x block) units: a session of max_length over k blocks takes k * max_length."""
        return max(0, self.core.bytes_left // self.cache_bytes_per_token_block)

    def _serialize_output(self, tensor: torch.Tensor, compression: int | None = None) -> runtime_pb2.Tensor:
        if tensor.dtype != self.limits.dtype:
            tensor = tensor.to(self.limits.dtype)
        return serialize_tensor(tensor, self.compression if compression is None else compression)

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
        metadata = ForwardRequestMetadata.from_dict(decode_metadata(raw_metadata))
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
        metadata = ForwardRequestMetadata.from_dict(decode_metadata(raw_metadata))
        adapter = bf.validate_adapter(metadata.active_adapter, self.limits)
        args = bf.unpack_request_args(tensors, metadata.args_structure)
        inputs = bf.parse_backward_inputs(args, self.limits, num_blocks=len(block_indices), adapter=adapter)
        compressions = self._output_compressions(metadata, 2 if inputs.has_prompts else 1)
        grads = await self.core.backward(peer, tuple(block_indices), inputs, timeout_s=self.timeouts.request_timeout_s)
        return [self._serialize_output(g, c) for g, c in zip(grads, compressions, strict=True)]

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        check_request(self.peer_auth, "rpc_forward", context, request)
        outputs = await self._run_logged("rpc_forward", self._unary(self._forward, request, context))
        return self._check_unary_size(runtime_pb2.ExpertResponse(tensors=outputs), "rpc_forward")

    async def rpc_forward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        requests = gate_stream(self.peer_auth, "rpc_forward_stream", requests, context)
        outputs = await self._run_logged("rpc_forward_stream", self._streamed(self._forward, requests, context))
        for response in stream_response(outputs):
            yield response

    async def rpc_backward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        check_request(self.peer_auth, "rpc_backward", context, request)
        outputs = await self._run_logged("rpc_backward", self._unary(self._backward, request, context))
        return self._check_unary_size(runtime_pb2.ExpertResponse(tensors=outputs), "rpc_backward")

    async def rpc_backward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        requests = gate_stream(self.peer_auth, "rpc_backward_stream", requests, context)
        outputs = await self._run_logged("rpc_backward_stream", self._streamed(self._backward, requests, context))
        for response in stream_response(outputs):
            yield response

    async def _unary(
        self, compute: _Compute, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> list[runtime_pb2.Tensor]:
        return await compute(request.uid, bf.deserialize_request(request.tensors), request.metadata, peer_key(context))

    async def _streamed(
        self, compute: _Compute, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> list[runtime_pb2.Tensor]:
        uid, serialized, metadata = await gather_stream(
            requests, request_timeout_s=self.timeouts.request_timeout_s, max_stream_bytes=self.max_stream_bytes
        )
        return await compute(uid, bf.deserialize_request(serialized), metadata, peer_key(context))

    def _reject(self, name: str, error: BaseException) -> None:
        """Logs and counts a refused request by reason (`refusals.rejection_reason`: by the error's type): the one
        place a refusal becomes a metric and a log line."""
        reason = rejection_reason(error)
        self.metrics.rejected(reason)
        logger.info(f"{name}.rejected(reason={reason}): {error}")

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

    def _schedule_push(
        self, request: runtime_pb2.ExpertRequest, output: runtime_pb2.Tensor, metadata: InferenceRequestMetadata
    ) -> None:
        if not metadata.next_servers or self.p2p is None:
            return
        task = asyncio.create_task(self._push_outputs(request, output, metadata))
        self._push_tasks.add(task)
        task.add_done_callback(self._push_tasks.discard)

    async def _push_outputs(
        self, request: runtime_pb2.ExpertRequest, output: runtime_pb2.Tensor, metadata: InferenceRequestMetadata
    ) -> None:
        hop, rest = metadata.next_servers[0], metadata.next_servers[1:]
        try:
            step_metadata = metadata.to_dict()
            step_metadata.update(session_id=hop.session_id, next_servers=[h.to_list() for h in rest], pushed=True)
            if self.peer_auth is not None:
                step_metadata.update(self.peer_auth.proof_metadata(hop.peer_id))
            pushed = runtime_pb2.ExpertRequest(
                uid=make_chain(self.limits.dht_prefix, hop.start, hop.end),
                tensors=[output, *request.tensors[1:]],
                metadata=encode_metadata(step_metadata),
            )
            if self.p2p is None:  # stopped meanwhile
                return
            if hop.peer_id == self.p2p.peer_id.to_base58():  # the next span is ours too: no network hop
                self.core.push(hop.session_id, pushed, sender=hop.peer_id)
                return
            stub = type(self).get_stub(self.p2p, PeerID.from_base58(hop.peer_id))
            await stub.rpc_push(pushed, timeout=self.timeouts.request_timeout_s)
        except Exception as e:
            logger.info(f"rpc_push.failed(peer={hop.peer_id:.12}): {e!r}")

    # ---- inference ------------------------------------------------------------------------------------------------

    async def rpc_inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        started = time.monotonic()
        deadline = started + self.timeouts.session_timeout_s
        requests = gate_stream(self.peer_auth, "rpc_inference", requests, context).__aiter__()
        try:
            first = await asyncio.wait_for(requests.__anext__(), self.timeouts.step_timeout_s)
        except (asyncio.TimeoutError, StopAsyncIteration):
            logger.info("rpc_inference.no_first_request")
            return
        try:
            self.handoff.check_accepting()
            block_indices = bf.resolve_chain(first.uid, self.limits)
            metadata = InferenceRequestMetadata.from_bytes(first.metadata)
            kv_import = self.handoff.import_header(metadata)  # a session moved here from a draining server
            adapter = bf.validate_adapter(metadata.active_adapter, self.limits)
            push_guard = SessionPushGuard.from_open_request(metadata)  # who may push into it (ValueError: bad id)
            declared_batch = int(first.tensors[0].size[0]) if first.tensors and len(first.tensors[0].size) > 0 else 1
            max_length, batch_size = bf.validate_session_open(metadata.max_length, declared_batch, self.limits)
            shadow = parse_shadow(metadata.extra)  # a client's mirror of another server's session: it goes last
        except (ValueError, Draining) as e:
            self._reject("rpc_inference", e)
            raise

        logger.info(
            f"rpc_inference.open(blocks={block_indices[0]}:{block_indices[-1] + 1}, batch={batch_size}, "
            f"max_length={max_length}, session_id={metadata.session_id!r:.40})"
        )
        self.sessions.open()
        inbox = PushInbox(metadata.session_id, push_guard) if metadata.session_id is not None else None
        try:
            spec = SessionSpec(tuple(block_indices), batch_size, max_length, shadow=shadow)
            opening: int | None = kv_import.position if kv_import is not None else _opening_tokens(first)
            if opening == 0 and probe_keys(first, metadata) is not None:
                opening = None  # a prefix probe: its tokens follow once the cached part is known
            reservation = self.core.open_session(
                peer_key(context), spec, metadata.alloc_timeout_s, metadata.session_id, inbox, opening_tokens=opening
            )  # per-peer caps, what yields under pressure, then the KV cache itself (none for a max_length=0 probe)
            async with reservation as (ticket, cache):
                self._report_cache()
                session = SessionState(
                    session_id=metadata.session_id,
                    block_indices=block_indices,
                    batch_size=batch_size,
                    max_length=max_length,
                    cache=cache,
                    active_adapter=adapter,
                    args_structure=metadata.args_structure,
                    push_queue=inbox.queue if inbox is not None else None,
                    push_guard=push_guard,  # peer_auth: what pushed steps may do
                    ticket=ticket,
                )
                if kv_import is not None:
                    await self.handoff.import_kv(session, kv_import, first.uid, requests)
                namespace = self.prefix_trust.namespace(peer_key(context), adapter)  # pushed steps: the owner's
                session.on_client_request = functools.partial(self._record_prefix_keys, session, namespace)
                probing = kv_import is None  # the first step may ask for a prefix hit
                steps = iterate_steps(first, requests, session, self.timeouts, deadline)
                async for request, step_metadata in steps:
                    hit = await self._attach_prefix(session, namespace, request, step_metadata) if probing else None
                    probing = False
                    if hw.EXPORT_KEY in step_metadata.extra:  # draining: the client moves the cache
                        async for response in self.handoff.export(session):
                            yield response
                        continue
                    if session.resend_pending:  # the client re-sent a step: never leave it without an answer
                        yield runtime_pb2.ExpertResponse(tensors=[session.resend_output(step_metadata.step_id)])
                        continue
                    try:
                        output, can_push = await self._inference_step(session, request, step_metadata, deadline)
                    except ValueError as e:
                        if not step_metadata.pushed:
                            raise
                        # a bad push (from another server) must not end this client's session
                        logger.info(f"rpc_inference.bad_push_ignored(session_id={session.session_id!r:.40}): {e}")
                        session.seen_step_ids.discard(step_metadata.step_id or "")
                        continue
                    session.record_output(step_metadata, output)
                    # (the guard learnt from a step of the session's own client when it was screened)
                    if can_push and step_metadata.next_servers and push_guard.may_push_on(step_metadata):
                        self._schedule_push(request, output, step_metadata)
                    drain_deadline = self.core.drain.deadline  # (while draining: the session's time left)
                    seconds_left = None if drain_deadline is None else drain_deadline - time.monotonic()
                    response = hw.step_response(output, seconds_left)
                    if step_metadata.pushed:
                        response = mark_pushed_reply(response)
                    yield response if hit is None else with_hit(response, hit)
        except Exception as e:
            self._reject("rpc_inference", e)
            raise
        finally:
            self.sessions.close()
            self._report_cache()
            logger.info(
                f"rpc_inference.close(session_id={metadata.session_id!r:.40}, seconds={time.monotonic() - started:.2f})"
            )

    async def _attach_prefix(
        self, session: SessionState, namespace: str, request: runtime_pb2.ExpertRequest,
        metadata: InferenceRequestMetadata,
    ) -> int | None:  # fmt: skip
        """The positions a session's first step reuses, if it asks (`prefix_keys.probe_keys`): the session then
        starts there. None for a first step that does not ask (a Petals client's)."""
        keys = probe_keys(request, metadata)
        if keys is None:
            return None
        hit = 0 if session.cache is None else await self.core.attach_prefix(session.cache, namespace, keys)
        session.prefix_length = hit
        if hit and session.ticket is not None:  # cached positions it starts with: real work, done before
            session.ticket.touch(hit * session.batch_size)
        self.metrics.prefix_probe(keyed_tokens=keys.end_position, hit_tokens=hit)
        logger.debug(f"rpc_inference.prefix_hit(session_id={session.session_id!r:.40}, tokens={hit})")
        return hit

    async def _step_within(self, session: SessionState, step: Awaitable[_T], remaining_s: float) -> _T:
        """The executor's `step` under the session's deadline: the session's `TaskDeadline` (one lazily moved timer
        for all its waits) where the loop has one, else `asyncio.timeout`."""
        if _timeout is None:
            return await _await_within(step, remaining_s)
        deadlines = session.deadlines
        if deadlines is None:
            deadlines = session.deadlines = TaskDeadline(asyncio.get_running_loop())
        with deadlines.scope(deadlines.loop.time() + remaining_s):
            return await step

    async def _inference_step(
        self,
        session: SessionState,
        request: runtime_pb2.ExpertRequest,
        metadata: InferenceRequestMetadata,
        deadline: float,
    ) -> tuple[runtime_pb2.Tensor, bool]:
        structure = metadata.args_structure if metadata.args_structure is not None else session.args_structure
        inputs = bf.decode_step(
            request.tensors,
            structure,
            self.limits,
            num_blocks=len(session.block_indices),
            batch_size=session.batch_size,
            current_length=session.prefix_length,
            start_from_position=metadata.start_from_position,
            max_length_tokens=session.max_length,
            adapter=session.active_adapter,
            lone_session=self.sessions.num_open == 1,  # (a handler process's: the device checks its own count)
        )  # the session changes only once the step is valid
        meta = inputs.hidden_meta  # the usual step's record of its bytes (no tensor built), else the tensor's shape
        batch_size, length, _ = meta[1] if meta is not None else inputs.tensor().shape
        if length == 0 or session.cache is None:
            output = self._serialize_output(inputs.tensor())  # zero tokens: nothing to compute, [B, 0, H] back
        else:
            assert session.cache is not None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimeout(f"inference session exceeded session_timeout={self.timeouts.session_timeout_s} s")
            try:
                step = self.core.step(session.cache, inputs)
                output = self._serialize_output(await self._step_within(session, step, remaining))
            except asyncio.TimeoutError:
                raise RequestTimeout(
                    f"inference session exceeded session_timeout={self.timeouts.session_timeout_s} s"
                ) from None
        session.prefix_length = inputs.prefix_length + length
        if session.ticket is not None:
            session.ticket.touch(batch_size * length)  # zero-token keep-alives are not use
        return output, inputs.prompts is None

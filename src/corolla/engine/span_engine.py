"""The session-level face of the fast path: `SpanEngine` owns the span's model (a `SpanModel` chosen from the blocks),
the KV pool sized by the model's per-token `KVLayout`, and the CUDA graphs; `EngineSession` is one client's
reservation in the pool, with its LoRA adapter (a merged step mixes sessions on different adapters: each row's
adapter index is a static input of the graphs)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from corolla.engine.config import EngineConfig
from corolla.engine.graph_decode import (
    HostStaging,
    PendingDecode,
    advance_lengths,
    host_bytes,
    launch_graph_decode,
    merge_rows,
    split_rows,
    stage_row_inputs,
)
from corolla.engine.graphs.cuda_graphs import DecodeGraphs
from corolla.engine.graphs.prefill_graphs import PrefillGraphs, graphs_serve
from corolla.engine.kernels.kernel_choices import KernelChoices, device_scope
from corolla.engine.kv.kv_pool import KVPool, SequenceSlot
from corolla.engine.kv.session_prefix import SessionPrefix
from corolla.engine.spans.adapter_rows import AdapterRows
from corolla.engine.spans.eager_span import EagerSpan
from corolla.engine.spans.fast_dense import DENSE_MODEL_TYPES, FastDenseSpan
from corolla.engine.spans.fast_llama import FastLlamaSpan
from corolla.engine.spans.fast_lora import SpanAdapters
from corolla.engine.spans.fast_mla import FastMlaSpan
from corolla.engine.spans.span_model import SpanModel
from corolla.engine.step_request import StepRequest, StepSession
from corolla.protocol.prefix import PREFIX_BLOCK_TOKENS, PrefixKeys
from corolla.utils.logging import get_logger

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = get_logger(__name__)


class EngineSession:
    """`batch_size` sequences of up to `max_length_tokens` promised by the engine's pool (pages taken as steps arrive), run through the engine's
    layers [first, end); a context manager that returns the pages on exit. All rows share one position (the client
    sends whole batches). `adapter` is the LoRA adapter of every step ("" = the base model; None = not fixed yet:
    `SpanEngine.bind_adapter` fixes it), `adapter_index` its index in the engine's `SpanAdapters` (0 = none)."""

    def __init__(
        self,
        engine: SpanEngine,
        slots: list[SequenceSlot],
        max_length_tokens: int,
        layers: tuple[int, int],
        adapter: str | None = None,
        adapter_index: int = 0,
    ):
        self.engine = engine
        self.slots = slots
        self.table_rows = [host_bytes(slot.table) for slot in slots]  # each block table's bytes, staged per step
        self.batch_size = len(slots)
        self.max_length_tokens = max_length_tokens
        self.layers = layers
        self.adapter = adapter
        self.adapter_index = adapter_index
        self.prefix: SessionPrefix | None = None  # the client's prefix keys (`SpanEngine.attach_prefix`), if any

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    @property
    def length_tokens(self) -> int:
        """Positions [0, length) hold keys/values written by earlier steps."""
        return self.slots[0].length_tokens

    @property
    def closed(self) -> bool:
        return self.slots[0].freed

    def close(self) -> None:
        """Publishes the pages its last steps filled, then lets go of its pages (idempotent)."""
        if not self.closed:
            self.engine.publish_prefix(self)
        self.engine.pool.free(self.slots)

    def __enter__(self) -> EngineSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class SpanEngine:
    """Fast inference for one span (any `SpanModel`); every compute method must be called from one thread (the
    server's device thread), while `open_session` and `EngineSession.close` are thread-safe."""

    def __init__(self, model: SpanModel, config: EngineConfig = EngineConfig(), *, adapters: AdapterRows | None = None):
        self.model = model
        self.config = config
        self.adapters = adapters  # the span's stacked LoRA adapters (the model reads the same object), or None
        if adapters is not None:
            adapters.allocate_rows(config.max_batch_rows)  # the per-row adapter index: a static input of the graphs
        self.device = model.device
        self.dtype = model.dtype
        spec = model.spec
        max_seq = min(config.max_seq_len_tokens, model.max_positions)
        if spec.sliding_window_tokens is not None:
            max_seq = min(max_seq, spec.sliding_window_tokens)  # full attention equals the window up to its length
        self.max_seq_len_tokens = max_seq
        page = config.page_size_tokens
        layout = spec.kv_layout
        page_bytes = KVPool.bytes_per_page(
            num_layers=model.num_layers, layout=layout, page_size_tokens=page, dtype=self.dtype
        )
        num_pages = max(1, config.kv_pool_bytes // page_bytes) + 1  # + the trash page, outside the budget
        self.pool = KVPool(
            num_layers=model.num_layers,
            layout=layout,
            num_pages=num_pages,
            page_size_tokens=page,
            max_pages_per_seq=-(-max_seq // page),
            dtype=self.dtype,
            device=self.device,
            prefix_cache_tokens=config.prefix_cache_tokens,
        )
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None  # short prefill chunks as CUDA graphs
        self.max_batch_rows = config.max_batch_rows
        if self.device.type == "cuda":
            if config.use_cuda_graphs and getattr(model, "supports_graphs", True):
                buckets = tuple(b for b in config.graph_buckets if b <= config.max_batch_rows) or (
                    config.max_batch_rows,
                )
                # only fused spans capture graphs (an eager span's `supports_graphs` is False): their adapters stack
                assert adapters is None or isinstance(adapters, SpanAdapters), (
                    "eager spans' adapters are never captured"
                )
                self.graphs = DecodeGraphs(model, self.pool, buckets, adapters=adapters)
                self.max_batch_rows = self.graphs.max_rows
            if config.use_cuda_graphs and config.prefill_graph_tokens and graphs_serve(model):
                assert isinstance(model, FastLlamaSpan)  # graphs_serve checked it
                tokens = min(config.prefill_graph_tokens, config.prefill_chunk_tokens)
                self.prefill_graphs = PrefillGraphs(model, self.pool, tokens)
            # two sets of pinned host buffers: a launched forward's asynchronous copies may still read (inputs) or
            # write (output) one set while the next forward is staged in the other (`launch_decode`)
            self._staging = [
                HostStaging.allocate(self.max_batch_rows, spec.hidden_size, self.pool.max_pages_per_seq, self.dtype)
                for _ in range(2)
            ]
            self._next_staging = 0

    @classmethod
    def from_blocks(
        cls, blocks: Sequence[torch.nn.Module], config: EngineConfig = EngineConfig(), *, fused: bool = True
    ) -> SpanEngine:
        """An engine over loaded blocks (their tensors are used in place). `fused`: the span type with fused kernels
        for the blocks' model type (llama family, DeepSeek-V3, Falcon/BLOOM) where it takes these blocks, else (or
        without `fused`) the blocks themselves run eagerly over the pool (`eager_span`). LoRA adapters on
        llama-family blocks are stacked (`fast_lora`)."""
        hf_config: PretrainedConfig | None = getattr(blocks[0], "config", None)  # corolla blocks keep their model's
        trained = getattr(hf_config, "max_position_embeddings", None)  # BLOOM (ALiBi) has no such limit
        max_positions = min(config.max_seq_len_tokens, int(trained or config.max_seq_len_tokens))
        if fused:
            try:
                model, adapters = fused_model(blocks, config, max_positions=max_positions)
                window = model.spec.sliding_window_tokens
                if window is not None and window < max_positions:
                    raise ValueError(f"the fused span attends to {window} tokens at most, the blocks' window slides")
                return cls(model, config, adapters=adapters)
            except ValueError as e:  # the fused span type refuses these blocks: their own code serves them
                logger.info(f"span_engine.eager(reason={e!r})")
        eager = EagerSpan(blocks, max_positions=max_positions)
        return cls(eager, config, adapters=eager.adapters)

    @property
    def fused(self) -> bool:
        """Whether the span runs on fused kernels (else its blocks run eagerly over the pool)."""
        return not isinstance(self.model, EagerSpan)

    @property
    def hidden_size(self) -> int:
        return self.model.spec.hidden_size

    def warmup(self) -> dict:
        """Chooses projection kernels (GPU: if `tune_gemm`; CPU, llama-family spans: if `cpu_linear.enabled`) and
        captures every CUDA-graph bucket now rather than at first use (GPU choices stored under
        `kernel_choices_dir` earlier are taken without timing), and compiles the short prefill chunks' kernels
        (`PrefillGraphs.warmup`: the first chunk after a cached prefix paid seconds). Call before serving; returns the
        kernel timings."""
        report = {}
        if self.device.type == "cuda" and self.config.tune_gemm:
            ops = getattr(self.model, "ops", None)
            if ops is not None and self.config.kernel_choices_dir is not None:
                ops.kernel_choices = KernelChoices(self.config.kernel_choices_dir, device_scope(self.device))
            report = self.model.tune()
        elif self.device.type == "cpu" and self.config.cpu_linear.enabled and isinstance(self.model, FastLlamaSpan):
            report = self.model.tune_cpu(self.config.cpu_linear)
        if self.graphs is not None:
            self.graphs.capture_all()
        if self.prefill_graphs is not None:
            self.prefill_graphs.warmup(self.pool.check_layers(None))
        return report

    # ------------------------------------------------------------------------------------------ sessions

    def open_session(
        self,
        batch_size: int,
        max_length_tokens: int,
        *,
        layers: tuple[int, int] | None = None,
        adapter: str | None = None,
    ) -> EngineSession:
        """Reserves pages for `batch_size` sequences over the engine's layers [first, end) (default: all), with LoRA
        `adapter` for all its steps ("" = none; None = fixed by the first `bind_adapter`, the base model if never);
        ValueError past `max_seq_len_tokens`, for a bad layer range or an unknown adapter, AllocationFailed when the
        pool is full."""
        span = self.check_session(max_length_tokens, layers)
        if adapter is not None:
            self.adapter_index(adapter)  # ValueError before any page is taken
        slots = self.pool.allocate(batch_size, max_length_tokens, span)
        return self.session_of(slots, max_length_tokens, layers=span, adapter=adapter)

    def check_session(self, max_length_tokens: int, layers: tuple[int, int] | None = None) -> tuple[int, int]:
        """The layer range [first, end) of a session (default: all); ValueError for a length past
        `max_seq_len_tokens` or a bad range."""
        if max_length_tokens > self.max_seq_len_tokens:
            raise ValueError(
                f"Cannot allocate KV cache for {max_length_tokens} tokens, max = {self.max_seq_len_tokens}"
            )
        return self.pool.check_layers(layers)

    def session_of(
        self, slots: list[SequenceSlot], max_length_tokens: int, *, layers: tuple[int, int], adapter: str | None = None
    ) -> EngineSession:
        """A session over `slots` taken from this engine's pool in `layers` (by `open_session` or a
        `page_queue.PageQueue`), after `check_session`."""
        if any(slot.layers != layers for slot in slots):
            raise ValueError(f"the slots hold pages in other layers than {layers}")
        adapter_index = 0 if adapter is None else self.adapter_index(adapter)
        return EngineSession(self, slots, max_length_tokens, layers, adapter, adapter_index)

    def adapter_index(self, name: str) -> int:
        """0 for "" (the base model), else adapter `name`'s index; ValueError for an adapter this span lacks."""
        if not name:
            return 0
        if self.adapters is None:
            raise ValueError(f"Unknown adapter {name!r}; this span has no adapters")
        return self.adapters.index_of(name)

    def bind_adapter(self, session: EngineSession, name: str) -> None:
        """Fixes `session`'s adapter to `name` if not fixed yet; ValueError if it is fixed to another one (a
        session keeps the adapter it opened with, as Petals' servers do) or unknown."""
        if session.adapter is None:
            session.adapter_index = self.adapter_index(name)
            session.adapter = name
        elif session.adapter != name:
            raise ValueError(
                f"This inference session uses adapter {session.adapter!r} (fixed when it opened), got {name!r}"
            )

    # ------------------------------------------------------------------------------------------ prefix caching

    def attach_prefix(self, session: EngineSession, namespace: str, keys: PrefixKeys) -> int:
        """Records the client's `keys` for a fresh `session` and starts it with the longest run of cached pages they
        name, computed over its layers by sessions of `namespace`; returns the positions reused (whole pages). A
        session of several sequences reuses nothing and publishes nothing: keys name one sequence. ValueError once
        the session has positions."""
        if session.length_tokens or any(slot.pages for slot in session.slots):
            raise ValueError("a prefix is attached only before a session's first position")
        self.add_prefix_keys(session, namespace, keys)
        prefix = session.prefix
        if prefix is None:
            return 0
        pages = self.pool.attach_prefix(session.slots[0], prefix.keys_from(0))
        prefix.next_page = pages
        return pages * self.pool.page_size_tokens

    def add_prefix_keys(self, session: EngineSession, namespace: str, keys: PrefixKeys) -> None:
        """Records more of the client's keys (its generated tokens' blocks, or blocks it named anew after a
        rollback); their pages are published once computed."""
        prefix = session.prefix or self._prefix_of(session, namespace)
        if prefix is not None:
            if prefix.namespace != namespace:
                raise ValueError("a session's prefix keys belong to the identity that opened it")
            prefix.add(keys)

    def publish_prefix(self, session: StepSession) -> int:
        """Indexes every computed, keyed page of `session` not published yet, in order up to the first page without
        a key; returns how many were indexed (a page whose key is cached already stays the session's own). Called
        before each step (`validate`) and when the session closes."""
        prefix = session.prefix
        if prefix is None or session.closed:
            return 0
        slot, page = session.slots[0], prefix.next_page
        published = 0
        while (page + 1) * self.pool.page_size_tokens <= slot.length_tokens:
            key = prefix.page_key(page)
            if key is None:
                break
            published += self.pool.publish(slot, page, key)
            page += 1
        prefix.next_page = page
        return published

    def _prefix_of(self, session: EngineSession, namespace: str) -> SessionPrefix | None:
        if session.batch_size != 1:
            return None
        session.prefix = SessionPrefix(
            namespace=namespace,
            layers=session.layers,
            page_tokens=self.pool.page_size_tokens,
            max_blocks=session.max_length_tokens // PREFIX_BLOCK_TOKENS,
        )
        return session.prefix

    # ------------------------------------------------------------------------------------------ steps

    def validate(self, req: StepRequest) -> None:
        """ValueError describing the first problem with a step request (before any compute): its inputs (once:
        `check_inputs`), then the session's state (closed, positions already processed, maximum length); then takes
        the pages its positions need (`KVPool.grow`: AllocationFailed only where the pool is fragmented)."""
        if not req.inputs_checked:
            self.check_inputs(req)
        session, position = req.session, req.position
        slots = session.slots
        first = slots[0]  # (`session.closed` and `length_tokens` read from it here: no property call per row)
        if first.freed:
            raise ValueError("The inference session is closed")
        if position < 0 or position > first.length_tokens:
            raise ValueError(
                f"start position {position} must lie in [0, {first.length_tokens}] (tokens already processed)"
            )
        end = position + req.num_tokens
        if end > session.max_length_tokens:
            raise ValueError(
                f"Maximum length exceeded: prefix {position} + current {req.num_tokens} exceeds pre-allocated "
                f"maximum {session.max_length_tokens}"
            )
        # a page the session shares (an attached prefix) or published is copied before the step writes into it (a
        # no-op unless the step rolls back into such pages); the step's positions take their pages now (promised at
        # open): a no-op until a page fills
        prefix = session.prefix
        if prefix is not None:  # pages filled by earlier steps are published before this step may rewrite any
            self.publish_prefix(session)
            prefix.rewind(position)
        pool = self.pool
        page_tokens = pool.page_size_tokens
        pages, grow = -(-end // page_tokens), False
        for slot in slots:  # (the tests `prepare_write` and `grow` start with, inlined: every decode step)
            if position < slot.length_tokens or position < slot.shared_pages * page_tokens:
                pool.prepare_write(slot, position)
            grow = grow or len(slot.pages) < pages
        if grow:  # a page fills
            pool.grow(slots, end)

    def check_inputs(self, req: StepRequest) -> None:
        """ValueError for a step request whose inputs can't run on this engine whatever the session's state (its
        engine, shapes, dtypes, beam ids, prompts); marks it checked. Called once where the step enters (a device
        channel's reader thread, through `EngineExecutor.prepare_step`) or by `validate`."""
        session, dtype = req.session, req.dtype
        if session.engine is not self:
            raise ValueError("The session belongs to another engine")
        shape = req.shape  # [B, T, H]
        if len(shape) != 3 or shape[0] != session.batch_size or shape[2] != self.hidden_size:
            raise ValueError(
                f"hidden states must be [{session.batch_size}, tokens, {self.hidden_size}], got {tuple(shape)}"
            )
        if not dtype.is_floating_point:
            raise ValueError(f"hidden states must be floating point, got {dtype}")
        raw = req.hidden_bytes
        if raw is not None and (raw.nbytes != shape[0] * shape[1] * shape[2] * dtype.itemsize
                                or raw.ndim != 1 or raw.format != "B"):  # fmt: skip
            raise ValueError(f"hidden states' bytes must be {tuple(shape)} {dtype} flat, got {raw.nbytes} bytes")
        if req.hypo_ids is not None and req.hypo_ids.numel() > 0:
            ids = req.hypo_ids
            if ids.ndim != 1 or len(ids) != session.batch_size or ids.dtype != torch.int64:
                raise ValueError(
                    f"hypo_ids must be int64 of shape [{session.batch_size}], got {ids.dtype} {tuple(ids.shape)}"
                )
            if bool(((ids < 0) | (ids >= session.batch_size)).any()):
                raise ValueError(f"hypo_ids must lie in [0, {session.batch_size}), got {ids.tolist()}")
        if req.prompts is not None and req.prompts.numel() > 0:
            p = req.prompts
            if p.ndim != 4 or p.shape[0] != session.num_layers or p.shape[1] not in (1, session.batch_size):
                raise ValueError(
                    f"prompts must be [{session.num_layers}, 1 or {session.batch_size}, length, {self.hidden_size}], "
                    f"got {tuple(p.shape)}"
                )
            if p.shape[3] != self.hidden_size:
                raise ValueError(f"prompts must end with hidden size {self.hidden_size}, got {tuple(p.shape)}")
        req.inputs_checked = True

    def _prepare(self, req: StepRequest, *, validated: bool = False) -> None:
        if not validated:
            self.validate(req)
        if req.hypo_ids is not None and req.hypo_ids.numel() > 0:
            self.pool.reorder(req.session.slots, req.hypo_ids)

    def step(
        self,
        session: StepSession,
        hidden: torch.Tensor,
        position: int,
        hypo_ids: torch.Tensor | None = None,
        prompts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One step of one session: hidden [B, T, H] -> [B, T, H] (on hidden's device, in the engine's dtype)."""
        req = StepRequest(session, hidden, int(position), hypo_ids, prompts)
        if req.is_decode:
            return self.decode_many([req])[0]
        self._prepare(req)
        return self._prefill(req)

    def _prefill(self, req: StepRequest) -> torch.Tensor:
        b, t, h = req.hidden.shape
        if t == 0:
            return torch.empty((b, 0, h), dtype=self.dtype, device=req.hidden.device)
        hidden = req.hidden.to(self.device, self.dtype, non_blocking=True)
        prompts = None
        if req.needs_prompts and req.prompts is not None:
            prompts = req.prompts.to(self.device, self.dtype)  # [layers, B or 1, P, H]
        outs = []
        selected = (
            self.adapters.prefill_adapter(req.session.adapter_index)
            if self.adapters is not None
            else contextlib.nullcontext()
        )
        with selected:
            for row, slot in enumerate(req.session.slots):
                row_prompts = None if prompts is None else prompts[:, row if prompts.shape[1] > 1 else 0]  # [L, P, H]
                graphs = self.prefill_graphs
                if graphs is not None and row_prompts is None and graphs.takes(t):
                    outs.append(graphs.run(hidden[row], req.position, slot, self.pool.check_layers(req.session.layers)))
                    continue
                outs.append(
                    self.model.prefill(
                        hidden[row],
                        req.position,
                        slot,
                        self.pool,
                        chunk_tokens=self.config.prefill_chunk_tokens,
                        layers=req.session.layers,
                        prompts=row_prompts,
                    )
                )
        for slot in req.session.slots:
            slot.length_tokens = req.position + t
        return torch.stack(outs).to(req.hidden.device)

    def decode_many(self, reqs: Sequence[StepRequest], *, validated: bool = False) -> list[torch.Tensor]:
        """Decode steps of several sessions over the same layers (`StepRequest.is_decode`: single-token steps, or
        short steps marked so, as B x T rows) as one batched forward per `max_batch_rows` rows; every request must
        be valid (see `validate`) and no session may appear twice. Returns [B_i, T_i, H] per request.
        `validated=True` skips `validate` (the caller just ran it)."""
        for req in reqs:
            if not req.is_decode:
                raise ValueError(f"decode_many takes decode steps without prompts, got {req.num_tokens} tokens")
            self._prepare(req, validated=validated)
        if len({id(r.session) for r in reqs}) != len(reqs):
            raise ValueError("decode_many got two steps of one session; run them one after another")
        if len({r.session.layers for r in reqs}) > 1:
            raise ValueError("decode_many got sessions over different layer ranges; batch them separately")
        results: list[torch.Tensor] = []
        group: list[StepRequest] = []
        rows = 0
        for req in reqs:
            if group and rows + req.rows * req.num_tokens > self.max_batch_rows:
                results.extend(self._decode_group(group))
                group, rows = [], 0
            group.append(req)
            rows += req.rows * req.num_tokens
        if group:
            results.extend(self._decode_group(group))
        return results

    def can_launch(self, reqs: Sequence[StepRequest]) -> bool:
        """Whether `launch_decode` takes these steps: decode steps (`StepRequest.is_decode`) of distinct sessions
        over one layer range, hidden states on the CPU, at most one CUDA-graph forward's rows (the graph path)."""
        graphs = self.graphs
        if graphs is None or not reqs:
            return False
        layers = reqs[0].session.layers
        rows = 0
        sessions = []
        for r in reqs:
            session = r.session
            if not r.is_decode or session.layers != layers or not r.on_cpu:
                return False
            rows += r.rows * r.num_tokens
            sessions.append(session)
        return rows <= graphs.max_rows and len(set(map(id, sessions))) == len(reqs)

    def launch_decode(
        self, reqs: Sequence[StepRequest], *, validated: bool = False, launchable: bool = False
    ) -> PendingDecode:
        """`decode_many` in two phases: queues one merged forward of `reqs` on the device and returns at once;
        `wait()` on the result gives [B_i, T_i, H] per request. ValueError unless `can_launch(reqs)`; each request
        must be valid (`validate`; `validated=True` skips it). `launchable=True`: the caller found `can_launch`
        true for these requests or a set that holds them all (not checked again). A later launch (or
        `decode_many`, `step`) may be made before `wait`: it runs after this forward in stream order."""
        if not reqs or (not launchable and not self.can_launch(reqs)):
            raise ValueError("launch_decode takes decode steps on the CPU of distinct sessions over one layer range, "
                             "on the CUDA-graph path, within one forward's rows")  # fmt: skip
        pool = self.pool
        for req in reqs:  # (`_prepare` inlined: every decode step of a launched forward passes here)
            if not validated:
                self.validate(req)
            if req.hypo_ids is not None and req.hypo_ids.numel() > 0:
                pool.reorder(req.session.slots, req.hypo_ids)
        return self._launch_group(reqs)

    def _launch_group(self, reqs: Sequence[StepRequest]) -> PendingDecode:
        """`launch_decode` after `_prepare` (beam reordering done once, by the caller)."""
        assert self.graphs is not None
        staging = self._staging[self._next_staging]
        self._next_staging = 1 - self._next_staging
        adapted = self.adapters is not None and any(r.session.adapter_index for r in reqs)
        adapter_rows = self.adapters.row_ids if self.adapters is not None and adapted else None
        return launch_graph_decode(self.graphs, staging, reqs, dtype=self.dtype, adapter_rows=adapter_rows)

    def _decode_group(self, group: list[StepRequest]) -> list[torch.Tensor]:
        if self.can_launch(group):  # the graph path with CPU inputs: launch, then wait at once
            return self._launch_group(group).wait()
        h = self.hidden_size
        merged = merge_rows(group, self.dtype)
        positions, ids = merged.positions, merged.adapter_ids
        all_cpu, same_dtype = merged.all_cpu, merged.same_dtype
        rows = merged.rows
        adapted = any(ids)  # no row on an adapter: the step skips the adapters entirely
        if self.graphs is not None and rows <= self.graphs.max_rows:  # inputs on the device (CPU ones launch)
            g = self.graphs
            staging = self._staging[self._next_staging]
            self._next_staging = 1 - self._next_staging
            staging.reuse()  # no queued copy of a launched forward reads it any more
            views = staging.row_views(g, rows)
            adapter_rows = self.adapters.row_ids if self.adapters is not None and adapted else None
            stage_row_inputs(staging, views, merged, adapter_rows is not None)  # the whole bucket: no reset in `run`
            views.graph_head.copy_(views.head, non_blocking=True)  # positions and tables: one copy
            if adapter_rows is not None:
                adapter_rows[: views.bucket].copy_(views.adapter_ids, non_blocking=True)
            # the hidden states straight into the graph's input: one copy (or one cat) kernel, no temporary
            if merged.shapes is None and len(group) == 1:
                views.graph_rows.copy_(group[0].hidden)  # [B, 1, H], any dtype or device
            elif merged.shapes is None and same_dtype and all(r.hidden.device == self.device for r in group):
                torch.cat([r.hidden for r in group], out=views.graph_rows)  # [rows, 1, H]
            else:
                views.graph_rows.view(rows, h).copy_(
                    torch.cat([r.hidden.reshape(-1, h).to(self.device, self.dtype) for r in group])
                )
            out = g.run(rows, group[0].session.layers, adapters=adapted, reset=False)  # [rows, H], static buffer
            # the set's copies above are done once the device passes this (recorded after the replay: the host
            # work before it keeps the device idle, the work after it is queued while the graph runs)
            staging.mark(torch.cuda.current_stream(self.device))
        else:
            on_device = all_cpu if self.device.type == "cpu" else all(r.hidden.device == self.device for r in group)
            if same_dtype and on_device and not merged.shapes:
                hidden = torch.cat([r.hidden for r in group]).view(rows, h)  # [rows, H]
            else:
                hidden = torch.cat([r.hidden.reshape(-1, h).to(self.device, self.dtype) for r in group])
            pos = torch.tensor(positions, dtype=torch.long, device=self.device)
            needed_pages = max(positions) // self.pool.page_size_tokens + 1  # eager path: attend to used pages only
            tab = merged.tables()[:, :needed_pages].to(self.device)
            selected: contextlib.AbstractContextManager = contextlib.nullcontext()
            if self.adapters is not None:
                self.adapters.row_ids[:rows].copy_(torch.tensor(ids, dtype=torch.long))
                selected = self.adapters.decode_rows(adapted)
            with selected:
                out = self.model.decode(hidden, pos, tab, self.pool, group[0].session.layers)  # [rows, H]
        advance_lengths(group)
        if self.device.type == "cuda" and all_cpu:
            out = out.cpu()  # CPU callers (eager path: no CUDA graphs)
        elif self.device.type == "cuda":
            out = out.clone()  # the graph's static output is reused by the next replay
        # one split into views: [rows, H] -> [B_i, T_i, H] per request
        pieces = split_rows(out.view(rows, 1, h), merged.splits, merged.shapes)
        if all_cpu and out.device.type == "cpu":
            return pieces
        return [p if p.device == r.hidden.device else p.to(r.hidden.device) for p, r in zip(pieces, group, strict=True)]


def fused_model(
    blocks: Sequence[torch.nn.Module], config: EngineConfig, *, max_positions: int
) -> tuple[SpanModel, SpanAdapters | None]:
    """The fused span of the blocks' model type (and its stacked LoRA adapters); ValueError where it can't take
    them (a layer type, activation, quantization or adapter target it does not implement)."""
    model_type = getattr(getattr(blocks[0], "config", None), "model_type", None)
    if model_type == "deepseek_v3":
        return FastMlaSpan.from_blocks(blocks, max_positions=max_positions, use_triton=config.use_triton), None
    span_type = FastDenseSpan if model_type in DENSE_MODEL_TYPES else FastLlamaSpan
    span = span_type.from_blocks(
        blocks,
        max_positions=max_positions,
        use_triton=config.use_triton,
        attention_splits_max=config.attention_splits_max,
    )
    return span, span.adapters if isinstance(span, FastLlamaSpan) else None

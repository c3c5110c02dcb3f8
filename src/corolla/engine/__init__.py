"""The GPU fast path for llama-family and DeepSeek-V3 spans: a server-wide paged KV pool (`kv_pool`, pages of a
per-token `KVLayout`), fused span weights with a batched ragged decode step and chunked prefill behind the
`span_model.SpanModel` seam (`fast_llama`, kernels in `ops`/`triton_kernels`; `fast_mla` for multi-head latent
attention, its ops in `mla_kernels`), whole-span CUDA
graphs per batch bucket (`cuda_graphs`), the session-level facade (`span_engine`) and the merging of queued steps of
many sessions into batched forwards (`batcher.execute_steps`, which the server's runtime calls). Runs on CPU too (reference ops, no graphs) so that tests check the same math."""

from corolla.engine.config import EngineConfig, LlamaSpec
from corolla.engine.kv_pool import KVPool
from corolla.engine.span_engine import EngineSession, SpanEngine

__all__ = ["EngineConfig", "EngineSession", "KVPool", "LlamaSpec", "SpanEngine"]

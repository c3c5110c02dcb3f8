"""The engine: runs spans of transformer blocks fast over one paged KV store. Its API sits at the top: `SpanEngine`
(`span_engine`, the session-level face), `StepRequest` (`step_request`), `batcher.execute_steps` (merges queued steps
of many sessions into batched forwards; the server's runtime calls it; on the graph path a forward is launched and
finished in two phases, `graph_decode`), `EngineConfig` (`config`) and `serving.unsupported_reason`. Below it, one folder per concept: `kv/` (the pool, page queue, prefix index), `spans/`
(a span model per family behind the `SpanModel` seam), `graphs/` (CUDA graphs), `kernels/` (Triton kernels with
torch references, tuners), `quant/` (NF4/INT8 weights and kernels), `moe/` (routed experts), `ops/` (the decode
step's operations dispatched to them). Runs on CPU too
(reference ops, no graphs) so that tests check the same math."""

from corolla.engine.config import EngineConfig
from corolla.engine.kv.kv_pool import KVPool
from corolla.engine.span_engine import EngineSession, SpanEngine
from corolla.engine.spans.fast_llama import LlamaSpec

__all__ = ["EngineConfig", "EngineSession", "KVPool", "LlamaSpec", "SpanEngine"]

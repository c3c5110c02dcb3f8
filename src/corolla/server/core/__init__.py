"""The core: what a server owns once a request is valid. The one seam every front talks to (`span_core.CoreClient`)
and the core behind it (`span_core.SpanCore`), the executor seam inside the core (`executor.SpanExecutor`) and its
implementation (`engine_executor`, `forward_chunks`); the device thread, its task queue and scheduler (`runtime`), its gather rule (`gather`) and its batch counts
(`batch_counts`, what the metrics read); all session state:
admission and fair-use limits (`admission`, `limits`), the push table (`span_core`), what a pushed step may do
(`push_guard`), a stream's sessions and step iterator (`sessions`), drain with KV hand-off (`drain`, `kv_handoff`);
and every typed refusal (`refusals`)."""

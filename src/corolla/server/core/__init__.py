"""The core: what a server owns once a request is valid. The seam every front talks to (`executor.SpanExecutor`)
and its implementation on the engine (`engine_executor`, `forward_chunks`); the device thread and its scheduler
(`runtime`, `task`, `gather`, `deadlines`); all session state: the registry and step iterator (`sessions`),
admission and fair-use limits (`admission`, `limits`), what a pushed step may do (`push_guard`), drain with KV hand-off (`drain`, `kv_handoff`); and every
typed refusal (`refusals`)."""

"""The core: what a server owns once a request is valid. The one seam every front talks to (`span_core.CoreClient`)
and the core behind it (`span_core.SpanCore`: admission, the push table, forward slots, the drain's `DrainState`), the
device side behind it (`engine_executor`, `forward_chunks`; the records that cross to it: `executor`);
the device thread, its task queue and scheduler (`runtime`), its gather rule (`gather`) and its batch counts
(`batch_counts`, what the metrics read); admission and fair-use limits (`admission`, `limits`), what a pushed step may
do (`push_guard`), the KV hand-off layout (`kv_handoff`), training's merged block calls (`training_batch`,
`training_graphs`, `training_activations`) and every typed refusal (`refusals`). A stream's session and steps are the
front's (`front.inference_stream`)."""

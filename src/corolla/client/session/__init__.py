"""Inference sessions: one stream per server span (`span_session`) with stall detection (`stalls`),
server-to-server forwarding (`forwarding`) and the drain's KV hand-off (`handoff`), and the chain of them with
fail-over by replay (`inference_session`)."""

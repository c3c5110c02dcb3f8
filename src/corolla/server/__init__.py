"""Turning "I host blocks i..j" into answered RPCs. `config` (ServerConfig) -> `server` (the `Server` lifecycle:
settings, block choice, rebalancing, restarts) -> `block_loading` (the span's blocks) + `span_service` (runtime +
handler for one span). Per request: `handler` (transport only) -> `block_functions` (validation, request -> calls)
-> `runtime` + `task` (the device thread, priorities, batch executors) -> `backend` (math over a span).
Around them: `memory_cache` (KV budget), `sessions` (timeouts), `announcer` (DHT heartbeat), `throughput`,
`sizing`, `metrics`; `engine/` holds the CUDA fast path (paged KV, fused span, CUDA graphs, continuous batching)."""

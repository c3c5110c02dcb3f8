"""Turning "I host blocks i..j" into answered RPCs. `config` (ServerConfig) -> `server` (the `Server` lifecycle:
settings, block choice, rebalancing, restarts) -> `block_loading` (the span's blocks) + `span_service` (runtime +
handler for one span). Per request: `handler` (transport only) -> `block_functions` (validation, request -> calls)
-> `runtime` + `task` (the device thread, priorities, batch executors) -> `engine_executor` (the span on the
engine: its paged KV pool, fused or eager blocks, merged decode steps) and `backend` (forward/backward over a span).
Around them: `sessions` (timeouts), `announcer` (DHT heartbeat), `throughput`, `sizing`, `metrics`."""

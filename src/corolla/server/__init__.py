"""Turning "I host blocks i..j" into answered RPCs. This top folder is the lifecycle and its wiring: `config`
(ServerConfig) -> `server` (the `Server` lifecycle: settings, block choice, rebalancing, restarts) -> `block_loading`
(the span's blocks) + `span_service` (core + fronts for one span), with `announcer`, `swarm_seat`, `throughput`,
`sizing`, `metrics` around them. Per request: `front/` (transports, bounded reads, the one decoder) -> `core/` (the
executor, sessions, admission, the runtime's scheduler, the engine executor); `handlers/` holds the
handler processes, extra fronts in other processes."""

"""Turning "I host blocks i..j" into answered RPCs: `handler` (transport only), `block_functions` (math only),
`backend` (a span of blocks), `memory_cache` (KV budget), `runtime` (the device thread), `throughput`,
`sizing`, `announcer` and the `Server` lifecycle."""

"""`corolla-bench`: measures the GPU fast path against the memory-bandwidth floor and `transformers` on the same
card in one run. `measure` (timers, copy bandwidth), `model` (random-weight model of a given shape),
`hf_baseline` (eager and compiled decode, prefill), `engine_bench` (span step, prefill, concurrent sessions),
`rpc_bench` (client-observed step through a local server), `report` (table, JSON, plot), `cli` (orchestration)."""

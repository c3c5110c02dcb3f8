"""`python -m benchmarks.prefix`: prefix caching measured through corolla-api on a loopback chain of two CPU servers.

`workload` makes the multi-turn chat replay (a generator with LMSYS-Chat-1M's published averages, or a trace in the
public Mooncake format with per-block hash ids), `checkpoint` writes the random model and its word-level tokenizer,
`replay` drives the gateway (streaming, TTFT per request), `run` replays the same workload with the client's prefix
reuse off then on in one run and reports prefill tokens saved, TTFT p50 and the hit rate."""

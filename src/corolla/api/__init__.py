"""OpenAI- and vLLM-compatible HTTP gateway over a swarm (`corolla-api`).

`schemas` (request models; unknown or unimplemented fields are 400s), `errors` (OpenAI-style error bodies), `sampling`
(every sampling parameter on logits, logprobs), `generation` (the per-request loop: `n` choices, stops), `textstream`
(incremental detokenization and stop-sequence cutting), `backend` (the `GenerationBackend` protocol the app drives,
and `SwarmBackend` over a distributed model), `metrics` (`/metrics`), `service_routes` (`/health`, `/version`,
`/tokenize`, `/detokenize`, `/metrics`), `app` (`create_app`: routes, SSE streaming, concurrency).
"""

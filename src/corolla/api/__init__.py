"""OpenAI-compatible HTTP gateway over a swarm (`corolla-api`).

`schemas` (request models), `errors` (OpenAI-style error bodies), `sampling` (temperature/top-p/seed on logits),
`textstream` (incremental detokenization and stop-sequence cutting), `backend` (the `GenerationBackend` protocol the
app drives, and `SwarmBackend` over a distributed model), `app` (`create_app`: routes, SSE streaming, concurrency).
"""

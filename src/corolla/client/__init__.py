"""Using remote spans as local modules: `routing` (sequence manager), `inference_session` (fail-over),
`remote_sequential` (autograd through the swarm) and distributed causal-LM models with `generate()`."""

"""corolla's benchmarks: programs beside the product (never imported by `src/`), run from the repository root as
`python -m benchmarks.<name>`; each writes its raw results to the git-ignored `benchmarks/results/`, and
`RESULTS.md` keeps the current figure of each claim. `common` (timers, random models, the engine's step drivers),
`serving` (engine vs `transformers` on one card, then through a local server), `users` (many users through one
server), `engine` (per-family and quantized spans), `wan` (chains behind emulated WAN links), `two_gpu` (a model
no single GPU holds), `soak` (servers killed and restarted under generating clients), `swarm` (the swarm at scale
in simulated time), `swarm_live` (swarm policies on a live loopback swarm)."""

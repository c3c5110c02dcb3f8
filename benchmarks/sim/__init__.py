"""The swarm simulator: many servers and clients in simulated time, running swarm/'s real placement, rebalancing
and routing policies. `bound` (the best-known placement under Helix's capacity model, measured by `corolla.swarm.placement_flow`) and `helix` (its 24-node
anchor cluster) are the reference; the event core, catalogue, regions, churn, workload and the server and client
models make the simulation. `python -m benchmarks.sim` runs it (`--help`)."""

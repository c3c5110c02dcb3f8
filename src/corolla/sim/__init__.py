"""The swarm simulator: many servers and clients in simulated time, running swarm/'s real placement, rebalancing
and routing policies. `bound` (max-flow and best-known placement, Helix's capacity model) and `helix` (its 24-node
anchor cluster) are the reference; the event core, catalogue, regions, churn, workload and the server and client
models make the simulation."""

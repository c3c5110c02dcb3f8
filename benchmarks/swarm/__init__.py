"""The swarm at scale, in simulated time: Helix's max-flow anchor, the scale scenario under each policy on the same
seed, and the simulator's own speed on 1,000 servers and 10,000 sessions (`python -m benchmarks.swarm`)."""

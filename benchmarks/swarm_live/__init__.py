"""The live check of the swarm policies: Petals' against corolla's placement and routing on the same loopback
servers and clients (`python -m benchmarks.swarm_live`)."""

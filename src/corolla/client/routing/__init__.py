"""Which servers to use: `sequence_manager`'s `RemoteSequenceManager` (a fresh view of the swarm turned into
chains of server spans; the route math is a `corolla.swarm` policy) and the bans of failing or lying servers (`bans`)."""

"""Which servers to use: `sequence_manager`'s `RemoteSequenceManager` (a fresh view of the swarm turned into
chains of server spans; the route math is a `corolla.swarm` policy), the bans of failing or lying servers (`bans`),
and the evidence behind a liar's ban: the finding record and its bounded codec (`findings`) and the findings this
client caught first-hand, kept in memory or on disk and banned again at start (`finding_store`)."""

"""Who serves what: the DHT/P2P factory with safe network defaults (`dht`), the node's signing identity
(`identity`), announcing and reading block records (`records_io`) and the signed ones (`signed_records`), span
reconstruction (`spans`); the policy seam (`policy`: placement, rebalancing and routing as pure functions) and
corolla's policy (`corolla_policy`, with `route_planning`, `routed_load`, `cache_refusals`, `early_announce`,
`rtt_book`), the max-flow bound (`placement_flow`); `reachability`, `ping`, private-swarm `membership`; `local`
starts a private loopback swarm of CLI processes."""

"""Who serves what: the DHT/P2P factory with safe network defaults (`dht`), announcing and reading block
records (`records_io`), span reconstruction (`spans`), the placement, rebalancing and routing policy (`policy`,
`corolla_policy`: pure functions), `reachability` and `ping`; `local` starts a private loopback swarm of CLI processes."""

"""Who serves what: the DHT/P2P factory with safe network defaults (`dht`), announcing and reading block
records (`records_io`), span reconstruction (`spans`), block selection and rebalancing math (`block_selection`,
pure functions), `reachability` and `ping`; `local` starts a private loopback swarm of CLI processes."""

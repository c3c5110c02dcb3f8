"""Who serves what: the DHT factory with safe network defaults and orphan-proofing (`dht`), announcing and reading
block records (`records_io`), span reconstruction (`spans`), block selection and rebalancing math
(`block_selection`, pure functions), pings (`ping`) and the public-swarm reachability check (`reachability`).
Every DHT call here is bounded by a timeout; nothing here imports `server` or `client`."""

"""What crosses the network, typed: DHT records (`records`), the uid grammar (`uids`), request metadata
(`metadata`), tensor codecs (`codecs`), args packing (`packing`) and the RPC service names and stubs (`rpc`).
Nothing here imports `server` or `client`; both sides share these definitions."""

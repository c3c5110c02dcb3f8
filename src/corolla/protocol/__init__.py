"""What crosses the network, typed: DHT records, uids, request metadata under the one bounded msgpack decoder, tensor
codecs, the RPC stubs and stream framings, and corolla's own extensions. Nothing here imports `server` or `client`;
both sides share these definitions."""

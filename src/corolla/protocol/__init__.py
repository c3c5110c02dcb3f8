"""What crosses the network, typed: DHT records (`records`), the uid grammar (`uids`), request metadata
(`metadata`) under the one bounded msgpack decoder (`bounded_msgpack`), tensor codecs (`codecs`), args packing
(`packing`), the RPC service names and stubs (`rpc`) and hivemind's stream framing (`stream_frames`); corolla's own:
the same-host and direct-port streams (`local_stream`, `direct_stream`), the handler channel's frames
(`channel_frames`), and the metadata of forwarding, KV hand-off, prefix caching, shadows and membership proofs
(`forwarding`, `handoff`, `prefix`, `shadow`, `auth`). Nothing here imports `server` or `client`; both sides share
these definitions."""

"""Prefix reuse, client side: the token keys of a session's positions and which servers take them (`prefix_chain`;
`SpanSession.probe` asks a server how much it holds) and cache-affine routing (`prefix_routes`)."""

"""Prefix reuse, client side: the token keys of a session's positions (`prefix_chain`), the probe of how much
each server holds (also `prefix_chain`) and cache-affine routing (`prefix_routes`)."""

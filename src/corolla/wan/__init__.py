"""A userspace WAN emulator for tests and benchmarks: `WanProxy` is an asyncio TCP proxy put in front of one server
(the server announces the proxy's address, so every connection to it crosses the proxy) that adds a one-way delay with
optional jitter, a bandwidth cap (asymmetric if asked) and retransmission stalls in both directions, preserving byte
order and bounding the bytes it holds; faults on demand: multi-second stalls, drops, partitions from chosen peers. `ProxyThread` runs proxies on a background event loop for synchronous code; `python -m corolla.wan`
runs one from a shell. Loopback only: it listens on and connects to 127.0.0.1 by default."""

from corolla.wan.config import LinkConfig
from corolla.wan.proxy import ProxyStats, WanProxy
from corolla.wan.runner import ProxyThread

__all__ = ["LinkConfig", "ProxyStats", "ProxyThread", "WanProxy"]

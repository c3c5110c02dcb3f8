"""A userspace WAN emulator for tests and benchmarks: `WanProxy` is an asyncio TCP proxy put in front of one server
(the server announces the proxy's address, so every connection to it crosses the proxy) that adds a one-way delay with
optional jitter, a bandwidth cap (asymmetric if asked) and retransmission stalls in both directions, preserving byte
order and bounding the bytes it holds; faults on demand: multi-second stalls, drops, partitions from chosen peers. `ProxyThread` runs proxies on a background event loop for synchronous code; `python -m benchmarks.wan_emulator`
runs one from a shell. Loopback only: it listens on and connects to 127.0.0.1 by default."""

from benchmarks.wan_emulator.config import LinkConfig
from benchmarks.wan_emulator.proxy import ProxyStats, WanProxy
from benchmarks.wan_emulator.runner import ProxyThread

__all__ = ["LinkConfig", "ProxyStats", "ProxyThread", "WanProxy"]

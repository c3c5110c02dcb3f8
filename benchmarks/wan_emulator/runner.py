"""`ProxyThread`: WAN proxies on an event loop of their own in a background thread, for synchronous code (tests,
`python -m benchmarks.wan`): `with ProxyThread() as wan: proxy = wan.add(target_port, LinkConfig(delay_ms=25))`;
`wan.stall(proxy, 5.0)`, `wan.drop(...)`, `wan.partition(...)`, `wan.heal(...)` apply faults from this thread. Leaving
the block closes every proxy and their connections and joins the thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import TypeVar

from benchmarks.wan_emulator.config import LinkConfig
from benchmarks.wan_emulator.proxy import WanProxy
from corolla.utils.logging import get_logger

logger = get_logger(__name__)
T = TypeVar("T")


class ProxyThread:
    """Owns a loop thread and the proxies started on it."""

    def __init__(self, call_timeout_s: float = 30.0):
        self.call_timeout_s = call_timeout_s
        self.loop = asyncio.new_event_loop()
        self.proxies: list[WanProxy] = []
        self._thread = threading.Thread(target=self.loop.run_forever, name="corolla-wan", daemon=True)
        self._thread.start()

    def _call(self, coro: Coroutine[object, object, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.call_timeout_s)

    def add(self, target_port: int, config: LinkConfig | None = None, *, listen_port: int = 0) -> WanProxy:
        """Starts a proxy to 127.0.0.1:`target_port` listening on 127.0.0.1:`listen_port` (0 = any free port)."""
        proxy = WanProxy(target_port=target_port, config=config, listen_port=listen_port)
        self._call(proxy.start())
        self.proxies.append(proxy)
        return proxy

    def remove(self, proxy: WanProxy) -> None:
        """Closes `proxy` and its connections (its server is gone for good)."""
        self._call(proxy.close())
        self.proxies.remove(proxy)

    def set_config(self, config: LinkConfig) -> None:
        """Gives every proxy `config` (for chunks read from now on)."""

        async def apply() -> None:
            for proxy in self.proxies:
                proxy.set_config(config)

        self._call(apply())

    def set_link(self, proxy: WanProxy, config: LinkConfig) -> None:
        """`proxy.set_config(config)` on the proxies' loop: one server's link only (`set_config`: every proxy's)."""
        self._on_loop(lambda: proxy.set_config(config))

    def stall(self, proxy: WanProxy, duration_s: float) -> None:
        """`proxy.stall(duration_s)` on the proxies' loop (see `WanProxy.stall`)."""
        self._on_loop(lambda: proxy.stall(duration_s))

    def drop(self, proxy: WanProxy, duration_s: float) -> None:
        self._on_loop(lambda: proxy.drop(duration_s))

    def partition(self, proxy: WanProxy, peer_ports: set[int] | None = None) -> None:
        self._on_loop(lambda: proxy.partition(peer_ports))

    def heal(self, proxy: WanProxy) -> None:
        self._on_loop(proxy.heal)

    def _on_loop(self, action: Callable[[], None]) -> None:
        async def apply() -> None:
            action()

        self._call(apply())

    def close(self) -> None:
        async def close_all() -> None:
            await asyncio.gather(*(p.close() for p in self.proxies), return_exceptions=True)

        try:
            if self._thread.is_alive():
                self._call(close_all())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            if not self._thread.is_alive():
                self.loop.close()

    def __enter__(self) -> ProxyThread:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

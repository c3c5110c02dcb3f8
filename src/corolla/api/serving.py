"""Runs an ASGI app (the API gateway or the health monitor) with uvicorn in a background thread, for the demo and
tests (`serve_in_thread(app, port=0)` binds a free loopback port and returns its URL) and, under
`serve_until_signalled`, for the CLIs (whose common flags `http_cli_parser` declares)."""

from __future__ import annotations

import argparse
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import configargparse
import uvicorn

from corolla.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass
class RunningServer:
    """A uvicorn server on a background thread; `close()` stops it (bounded wait)."""

    server: uvicorn.Server
    thread: threading.Thread
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=timeout_s)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(timeout=timeout_s)

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def serve_in_thread(
    app: Any, *, host: str = "127.0.0.1", port: int = 0, startup_timeout_s: float = 30.0
) -> RunningServer:
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{host}:{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"uvicorn did not start on {host}:{port} within {startup_timeout_s} s")
        time.sleep(0.02)
    bound_port = server.servers[0].sockets[0].getsockname()[1]
    logger.info(f"http.serving(url=http://{host}:{bound_port})")
    return RunningServer(server=server, thread=thread, host=host, port=bound_port)


def serve_until_signalled(app: Any, *, host: str, port: int, banner: str) -> None:
    """For CLIs: serves until SIGINT/SIGTERM; prints `banner` with "{url}" replaced once bound (port 0 = a free port)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with serve_in_thread(app, host=host, port=port) as running:
        print(banner.replace("{url}", running.url), flush=True)
        while not stop.wait(1.0):
            if not running.thread.is_alive():
                raise RuntimeError("the HTTP server stopped unexpectedly")


def http_cli_parser(prog: str, description: str, *, default_port: int) -> configargparse.ArgParser:
    """The argument parser of a CLI serving HTTP: `-c/--config` (a file with the same keys), `--host` (loopback by
    default) and `--port` (0 = a free port); the CLI adds its own flags."""
    parser = configargparse.ArgParser(
        prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("-c", "--config", is_config_file=True, help="YAML/INI config file with the same keys")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes it to the network)")
    parser.add_argument("--port", type=int, default=default_port, help="HTTP port (0 = a free port, printed at start)")
    return parser

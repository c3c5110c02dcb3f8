"""One place where every corolla CLI turns what went wrong into ONE line on stderr and an exit code: 2 for usage and
configuration errors (`ConfigurationError`, `ValueError`, a missing file or directory, a taken port), 1 for runtime
failures (unreachable peers, missing blocks, timeouts, anything else), 130 for Ctrl-C. No traceback unless
`--verbose` (or `COROLLA_VERBOSE=1`). Also the flags every CLI shares: `--version` and `--verbose`."""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import socket
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from corolla import __version__
from corolla.swarm.dht import check_peer_maddr
from corolla.utils.errors import BootstrapError, ConfigurationError, MissingBlocksError, PortInUseError
from corolla.utils.logging import quiet_logs

EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
_MAX_LINE_CHARS = 600


def add_common_flags(parser: argparse.ArgumentParser, *, verbose_help: str | None = None, swarm: bool = False) -> None:
    """`--version` and `--verbose` (tracebacks on errors, and the CLI's logs where it is quiet by default); with
    `swarm` (a CLI that joins one), `--swarm_key_file`."""
    parser.add_argument("--version", action="version", version=f"%(prog)s (corolla {__version__})")
    if swarm:
        parser.add_argument(
            "--swarm_key_file",
            default=None,
            help="private swarm with membership: the swarm key file (made by corolla-dht --new_swarm_key PATH)",
        )
    parser.add_argument(
        "--verbose", action="store_true", help=verbose_help or "print a traceback with errors, and debug details"
    )


def wants_verbose(argv: Sequence[str] | None) -> bool:
    """Whether `--verbose` was asked for, known before (and even when) parsing fails."""
    args = sys.argv[1:] if argv is None else argv
    return "--verbose" in args or os.environ.get("COROLLA_VERBOSE", "") not in ("", "0")


def classify(exc: BaseException) -> tuple[int, str]:
    """(exit code, one line) for an exception that ended a CLI."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted"
    if isinstance(exc, (ConfigurationError, PortInUseError)):
        return EXIT_USAGE, str(exc)
    if isinstance(exc, (BootstrapError, MissingBlocksError)):
        return EXIT_RUNTIME, str(exc)
    if isinstance(exc, FileNotFoundError):
        return EXIT_USAGE, f"no such file or directory: {exc.filename or exc}"
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return EXIT_USAGE, f"address already in use ({exc.strerror}); pick another port"
    if isinstance(exc, ValueError):
        return EXIT_USAGE, str(exc)
    if isinstance(exc, TimeoutError):
        return EXIT_RUNTIME, f"timed out: {exc}"
    return EXIT_RUNTIME, f"{type(exc).__name__}: {exc}"


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= _MAX_LINE_CHARS else line[: _MAX_LINE_CHARS - 3] + "..."


def run_cli(prog: str, body: Callable[[], int], argv: Sequence[str] | None = None, *, quiet: bool = False) -> int:
    """Runs a CLI's body; an exception becomes one line `PROG: error: ...` on stderr and its exit code. `quiet`: the
    body's logs are silenced unless `--verbose` (a client command whose output is its answer)."""
    verbose = wants_verbose(argv)
    try:
        with quiet_logs() if quiet and not verbose else contextlib.nullcontext():
            return body()
    except SystemExit:
        raise  # argparse's usage errors (code 2) and `--version` / `--help` (code 0)
    except BaseException as e:  # the CLI boundary: everything becomes one line
        code, line = classify(e)
        if verbose and not isinstance(e, KeyboardInterrupt):
            traceback.print_exc()
        # the line below is the verdict: teardown chatter (hivemind's "shutting down" warnings) would bury it
        logging.getLogger("hivemind").setLevel(logging.CRITICAL)
        if isinstance(e, KeyboardInterrupt):
            print(f"\n{prog}: interrupted", file=sys.stderr, flush=True)
        else:
            hint = "" if verbose else " (--verbose for details)" if code == EXIT_RUNTIME else ""
            print(f"\n{prog}: error: {_one_line(line)}{hint}", file=sys.stderr, flush=True)
        return code


def check_port_free(host: str, port: int, *, flag: str = "--port") -> None:
    """PortInUseError if `host:port` cannot be bound now (checked up front, before slow model loading). Port 0 and
    ports bound with SO_REUSEPORT by others are not checked."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and p2pd do: TIME_WAIT is fine
        try:
            sock.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PortInUseError(host, port, flag) from None
            if e.errno in (errno.EADDRNOTAVAIL, errno.EACCES):
                raise ConfigurationError(f"cannot listen on {host}:{port}: {e.strerror}") from None
            raise


def check_model_argument(name: str) -> None:
    """ConfigurationError for a local-looking model path that is not there (instead of the Hub's "Repo id must use
    alphanumeric chars"), or a directory without `config.json`. `ORG/NAME` and `NAME` may be Hub ids: not checked."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigurationError(f"model directory {name!r} has no config.json (is it a model checkpoint?)")
        return
    if path.exists():
        raise ConfigurationError(f"model {name!r} is a file; give the checkpoint's directory or a Hub id ORG/NAME")
    looks_local = name.startswith(("/", "./", "../", "~")) or name.count("/") >= 2 or name.endswith("/")
    if looks_local:
        raise ConfigurationError(f"no such model directory: {name!r} (nor is it a Hub id ORG/NAME)")


def check_initial_peers(peers: Sequence[str] | None) -> None:
    """Checks `--initial_peers` before anything slow starts (ConfigurationError naming a malformed address)."""
    for maddr in peers or ():
        check_peer_maddr(maddr)


def exit_now(code: int) -> Any:
    """Flushes and exits without the interpreter's teardown (torch and hivemind finalizers take seconds)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

"""The failure taxonomy shared by server and client: scarcity and missing coverage (bad input is `ValueError`)."""

from __future__ import annotations


class AllocationFailed(RuntimeError):
    """A resource (KV cache, device memory) could not be reserved within the allowed time."""


class MissingBlocksError(RuntimeError):
    """No server in the swarm currently serves some of the requested blocks."""

    def __init__(self, missing: list[int], message: str | None = None):
        self.missing = list(missing)
        super().__init__(message or f"No servers hold blocks {self.missing}; wait for servers to join or start one")


class NoHonestServerError(MissingBlocksError):
    """Client: every server tried for some blocks failed (refused, hung, died or returned bad outputs) until the retry
    budget (`ClientConfig.max_retries` / `max_wait_s`) ran out. `.missing` names the blocks, `.tried` and `.banned`
    the servers (base58 peer ids)."""

    def __init__(self, missing: list[int], *, tried: list[str], banned: list[str], waited_s: float, last_error: str):
        self.tried, self.banned, self.waited_s, self.last_error = list(tried), list(banned), waited_s, last_error
        blocks = f"{min(missing)}:{max(missing) + 1}" if missing else "?"
        short = ", ".join(f"...{peer[-6:]}" for peer in self.tried) or "none"
        banned_short = ", ".join(f"...{peer[-6:]}" for peer in self.banned) or "none"
        super().__init__(
            missing,
            f"no honest server for blocks {blocks} after {waited_s:.1f} s: tried {short}; banned {banned_short}; "
            f"last error: {last_error}",
        )


class ConfigurationError(ValueError):
    """A setting that cannot work here (bad flag value, missing model directory, taken port, unusable device): the
    CLIs print it as one line and exit with code 2; servers never retry it like a crash."""


class PortInUseError(ConfigurationError):
    """A port asked for with `--port` (or `--metrics_port`) is already taken on this host."""

    def __init__(self, host: str, port: int, flag: str = "--port"):
        self.host, self.port, self.flag = host, port, flag
        super().__init__(f"{host}:{port} is already in use; pick another {flag} (0 = a free port)")


class BootstrapError(RuntimeError):
    """Joining the swarm failed: none of `--initial_peers` answered (wrong address, peer down, other network or swarm
    key). Runtime failure (exit code 1); a malformed multiaddr is a `ConfigurationError` instead."""

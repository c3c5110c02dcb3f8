"""The failure taxonomy shared by server and client: scarcity and missing coverage (bad input is `ValueError`)."""

from __future__ import annotations


class AllocationFailed(RuntimeError):
    """A resource (KV cache, device memory) could not be reserved within the allowed time."""


class MissingBlocksError(RuntimeError):
    """No server in the swarm currently serves some of the requested blocks."""

    def __init__(self, missing: list[int], message: str | None = None):
        self.missing = list(missing)
        super().__init__(message or f"No servers hold blocks {self.missing}; wait for servers to join or start one")

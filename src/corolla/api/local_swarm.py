"""The private swarm of `corolla-api --new_swarm`: a `corolla.swarm.local.LocalSwarm` whose servers split a model's
blocks evenly, started (and waited for) when its context is entered, stopped on exit."""

from __future__ import annotations

from collections.abc import Sequence

from corolla.models.config import load_config
from corolla.swarm.local import LocalSwarm as _LocalSwarm
from corolla.swarm.local import LocalSwarmConfig, even_block_ranges
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


class LocalSwarm(_LocalSwarm):
    """`with LocalSwarm(model, num_servers=2) as swarm:` -> `swarm.initial_peers` of a ready loopback swarm."""

    def __init__(
        self,
        model: str,
        *,
        num_servers: int = 2,
        num_blocks: int | None = None,
        server_args: Sequence[str] = (),
        startup_timeout_s: float = 180.0,
        echo: bool = False,
    ):
        if num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {num_servers}")
        super().__init__(
            LocalSwarmConfig(
                server_args=tuple(server_args), echo=echo, startup_timeout_s=startup_timeout_s, stop_grace_s=10.0
            )
        )
        self.model = model
        self.num_servers = num_servers
        self.num_blocks = num_blocks

    def _spans(self) -> list[tuple[int, int]]:
        num_blocks = self.num_blocks
        if num_blocks is None:
            num_blocks = int(load_config(self.model).num_hidden_layers)
        return even_block_ranges(num_blocks, self.num_servers)

    def __enter__(self) -> LocalSwarm:
        try:
            self.start(self.model, self._spans())
        except BaseException:
            self.close()
            raise
        return self

"""The policies by name, for what measures corolla's policy against Petals' (`python -m benchmarks.sim run --policy`,
`benchmarks.swarm_live`): `corolla` (what `corolla-server` and the client run) and `petals` (the reference's math,
the measured baseline; no product option selects it)."""

from __future__ import annotations

from benchmarks.sim.petals_policy import PetalsPolicy
from corolla.swarm.corolla_policy import CorollaPolicy
from corolla.swarm.policy import SwarmPolicy

POLICY_NAMES = ("corolla", "petals")


def make_policy(name: str) -> SwarmPolicy:
    """The policy called `name` (one of `POLICY_NAMES`), with its defaults."""
    if name not in POLICY_NAMES:
        raise ValueError(f"swarm policy must be one of {POLICY_NAMES}, got {name!r}")
    return PetalsPolicy() if name == "petals" else CorollaPolicy()

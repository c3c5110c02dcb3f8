"""The policies by name, for what measures corolla's policy against Petals' (`python -m benchmarks.sim run --policy`,
`benchmarks.swarm_live`): `corolla` (what `corolla-server` and the client run) and `petals` (the reference's math,
the measured baseline; no product option selects it)."""

from __future__ import annotations

from corolla.swarm.corolla_policy import CorollaPolicy
from corolla.swarm.petals_policy import PetalsPolicy
from corolla.swarm.policy import SwarmPolicy, check_policy_name


def make_policy(name: str) -> SwarmPolicy:
    """The policy called `name` (one of `POLICY_NAMES`), with its defaults."""
    if check_policy_name(name) == "petals":
        return PetalsPolicy()
    return CorollaPolicy()

"""The policies by name (`--swarm_policy`): `petals` (the reference's math, the baseline) and `corolla`."""

from __future__ import annotations

from corolla.swarm.corolla_policy import CorollaPolicy
from corolla.swarm.petals_policy import PetalsPolicy
from corolla.swarm.policy import SwarmPolicy, check_policy_name


def make_policy(name: str, *, balance_quality: float | None = None) -> SwarmPolicy:
    """The policy called `name`; `balance_quality` is Petals' move threshold (its CLI flag; Petals only)."""
    if check_policy_name(name) == "petals":
        return PetalsPolicy() if balance_quality is None else PetalsPolicy(balance_quality=balance_quality)
    return CorollaPolicy()

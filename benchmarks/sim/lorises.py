"""Lorises in the simulated swarm (decision 0195): servers whose records claim `CLAIMED_RPS` blocks/s for decode and
prefill alike (routes take them first) while each decode step reaches the client just under the step deadlines'
1 s floor (`client.session.stalls.STALL_MIN_S`): never late, so only a judgment of what they deliver (decision 0189)
moves a session off one. A loris places its span and serves on its card as an honest server of it would."""

from __future__ import annotations

from benchmarks.sim.server_model import SimServer
from corolla.client.session.stalls import STALL_MIN_S

CLAIMED_RPS = 1e6
HOLD_STEP_S = 0.95 * STALL_MIN_S  # a decode step's time at the client (never late: under the floor)


def make_loris(server: SimServer) -> None:
    server.claimed_rps, server.hold_step_s = CLAIMED_RPS, HOLD_STEP_S

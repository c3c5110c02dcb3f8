"""Servers outside a dispute that this client only avoids are still asked to recheck it (decision 0228): an attacker
with free identities must not empty the recheck of honest outsiders by getting them avoided first (in-process fakes,
no network)."""

from __future__ import annotations

import random

import torch
from tests.unit.test_client_distrust import Framer, Server

from helpers.fake_chain import HIDDEN
from helpers.framed_session import framed_client, run_framed


class OneShot(Framer):
    """An attacker's identity that answers the framers' made-up outputs as a referee for its first `lies` requests,
    honest ones after (it serves honestly): the framing done, the session runs on and its outputs can be checked."""

    def __init__(self, start: int, end: int, lies: int):
        super().__init__(start, end, inference_rps=1e4)
        self.lies = lies

    async def rpc_forward(self, request, timeout=None):
        if self.forward_calls >= self.lies:
            return await Server.rpc_forward(self, request, timeout)
        return await super().rpc_forward(request, timeout)


class AttackersFirst(random.Random):
    """The draw the attack hopes for: the fresh pair F1, F2 referee H2's steps, the pair SA, SB H's (a list that holds
    H is drawn for H2 or another server, one without H for H itself)."""

    def shuffle(self, x: list) -> None:  # type: ignore[override]
        first = ("F1", "F2") if any(span.peer_id == "H" for span in x) else ("SA", "SB")
        x.sort(key=lambda span: span.peer_id not in first)


def test_an_honest_outsider_framed_away_first_still_rechecks_a_ban_on_standing():
    """Decision 0228, against 0208. H2 (honest, routed first) is framed by F1 and F2, two fresh identities of one
    attacker: short of standing, they only get it avoided 300 s (0190), and watched. The session moves to H (honest);
    SA (the attacker's identity with a witness's standing, earned as in
    `test_standing_earned_by_one_identity_is_not_lent_to_a_fresh_one`) and SB outvote it. 0208 rechecks the ban with
    the servers outside the dispute: on main those were the view's, and H2 had left the view with its avoidance, so
    the seats went to F1 and F2, which confirmed: H banned for good, its sessions the attacker's (without F1 and F2
    as outsiders: "unchecked", banned the same). Now the avoided H2 is asked too: it sides with H (split), nobody is
    banned."""
    torch.manual_seed(6)
    servers = {
        "H2": Server(0, 2, inference_rps=1e6),
        "H": Server(0, 2, inference_rps=1e5),
        "SA": OneShot(0, 2, lies=1),  # frames H
        "SB": OneShot(0, 2, lies=1),
        "F1": OneShot(0, 2, lies=2),  # frames H2, then confirms SA and SB as an outsider
        "F2": OneShot(0, 2, lies=2),
        "B": Server(2, 4),
        "B2": Server(2, 4),
    }
    tokens = torch.randn(1, 7, HIDDEN)
    manager = framed_client(servers, "SA", "B", "B2")
    run_framed(manager, tokens, AttackersFirst())
    assert "H2" in manager.avoided_peers() and {"F1", "F2"} <= manager.disputes.watched()  # the first framing
    assert not manager.bans.is_liar("H") and not manager.bans.is_banned("H"), manager.bans.banned_peers()
    assert servers["H2"].forward_calls == 1  # asked while avoided: the recheck of H's dispute
    assert "H" in manager.avoided_peers() and {"SA", "SB"} <= manager.disputes.watched()  # split: avoided, watched

"""Public swarm only: before going ONLINE, a server asks the swarm's health monitor whether it can reach it, and
refuses to serve (with advice) when it can't; a monitor that is down skips the check."""

from __future__ import annotations

import json
import time
import urllib.request

from corolla.utils.logging import get_logger

logger = get_logger(__name__)

REACHABILITY_API_URL = "https://health.petals.dev"
REACHABILITY_WAIT_S = 420.0
REACHABILITY_RETRY_S = 15.0


def validate_reachability(peer_id: str) -> None:
    """Asks the health monitor whether it reaches `peer_id`, retrying for up to 7 minutes (RuntimeError then)."""
    deadline = time.monotonic() + REACHABILITY_WAIT_S
    url = f"{REACHABILITY_API_URL}/api/v1/is_reachable/{peer_id}"
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                answer = json.loads(response.read())
        except Exception as e:
            logger.info(f"server.reachability_validation_skipped({e!r:.200})")
            return
        if answer.get("success"):
            logger.info("server.reachable(health monitor reached us directly)")
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"The swarm can't reach this server: {answer.get('message')}. Open a port and pass "
                f"--port <port> (and --public_ip {answer.get('your_ip', '<your ip>')} if behind NAT)"
            )
        logger.info("server.not_reachable_yet(retrying; relays may take a while)")
        time.sleep(REACHABILITY_RETRY_S)

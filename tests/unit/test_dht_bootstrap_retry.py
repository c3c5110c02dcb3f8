"""create_dht tries a bootstrap that no initial peer answered once more before it gives up (a busy bootstrap node
on a loaded machine missed the 3 s ping once in a full test run), and gives up with BootstrapError after that."""

from __future__ import annotations

import pytest

from corolla.swarm import dht as dht_module
from corolla.swarm.dht import SwarmConfig, create_dht
from corolla.utils.errors import BootstrapError

PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWGssBkjH2kANT2jVFQ3nv8xpqZRxAvr4iAAXVHKQMZQJm"


@pytest.fixture
def tries(monkeypatch):
    calls: list[dict] = []
    monkeypatch.setattr(dht_module, "install_p2pd_deathsig", lambda: None)
    monkeypatch.setattr(dht_module, "install_bounded_serializer", lambda: None)
    monkeypatch.setattr(dht_module, "BOOTSTRAP_RETRY_DELAY_S", 0.0)
    return calls, monkeypatch


def test_a_bootstrap_nobody_answered_is_tried_again(tries):
    calls, monkeypatch = tries
    node = object()

    def start(config, kwargs, initial_peers, num_workers):
        calls.append(kwargs)
        if len(calls) == 1:
            raise BootstrapError("could not reach any of --initial_peers")
        return node

    monkeypatch.setattr(dht_module, "_start_dht", start)
    assert create_dht(SwarmConfig(initial_peers=[PEER])) is node
    assert len(calls) == 2 and calls[0] is not calls[1]  # each try gets its own kwargs (identity set per try)


def test_it_gives_up_after_the_last_try_and_other_failures_are_not_retried(tries):
    calls, monkeypatch = tries

    def unreachable(config, kwargs, initial_peers, num_workers):
        calls.append(kwargs)
        raise BootstrapError("could not reach any of --initial_peers")

    monkeypatch.setattr(dht_module, "_start_dht", unreachable)
    with pytest.raises(BootstrapError):
        create_dht(SwarmConfig(initial_peers=[PEER]))
    assert len(calls) == dht_module.BOOTSTRAP_ATTEMPTS == 2

    calls.clear()

    def too_slow(config, kwargs, initial_peers, num_workers):
        calls.append(kwargs)
        raise TimeoutError("DHT did not start")

    monkeypatch.setattr(dht_module, "_start_dht", too_slow)
    with pytest.raises(TimeoutError):
        create_dht(SwarmConfig(initial_peers=[PEER]))
    assert len(calls) == 1

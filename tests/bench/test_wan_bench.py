"""`python -m benchmarks.wan` arithmetic: decode time per token from streamer arrivals, the floor (n+1)*d + c and the
relaying formula 2n*d + c from each mode's own d = 0 row, token identity against relaying, the markdown table and the
bypass check reading /proc/net/tcp."""

from __future__ import annotations

import socket

import pytest

from benchmarks.wan import run as wan
from benchmarks.wan.chain import established_remote_ports
from benchmarks.wan.measure import TokenClock, decode_ms_per_token
from benchmarks.wan.report import annotate, table


def test_decode_time_excludes_the_prefill_arrival_and_counts_burst_tokens() -> None:
    arrivals = [(10.0, 1), (10.1, 1), (10.2, 3), (10.3, 1)]  # a burst of 3 (speculative) counts 3 tokens
    assert decode_ms_per_token(arrivals) == pytest.approx(300.0 / 5)
    with pytest.raises(ValueError, match="at least 2"):
        decode_ms_per_token([(1.0, 1)])
    import torch

    clock = TokenClock()
    clock.put(torch.tensor([[1, 2, 3]]))  # the prompt: not an arrival
    clock.put(torch.tensor([4]))
    assert [n for _, n in clock.arrivals] == [1]


def _row(n: int, d: float, mode: str, ms: float | None, tokens: list[int], error: str | None = None) -> dict:
    return {
        "n": n, "delay_ms": d, "mode": mode, "ms_per_token": ms, "tokens": tokens, "error": error,
        "acceptance_rate": None, "ms_per_token_runs": [], "first_token_ms_runs": [],
    }  # fmt: skip


def test_floor_and_relaying_formula_use_each_modes_own_compute() -> None:
    rows = annotate(
        [
            _row(3, 0.0, "relaying", 10.0, [1, 2]),
            _row(3, 0.0, "forwarding", 12.0, [1, 2]),
            _row(3, 25.0, "relaying", 160.0, [1, 2]),
            _row(3, 25.0, "forwarding", 112.0, [1, 3]),
            {"n": 3, "check": {"via_proxy": 4}},
        ]
    )
    fwd = rows[3]
    assert fwd["c_ms"] == 12.0 and fwd["floor_ms"] == 4 * 25 + 12 and fwd["relay_formula_ms"] == 6 * 25 + 12
    assert fwd["x_floor"] == pytest.approx(1.0) and fwd["tok_s"] == pytest.approx(1000 / 112)
    assert rows[2]["same_tokens_as_relaying"] is True and fwd["same_tokens_as_relaying"] is False
    results = {
        "rows": rows, "date_utc": "now", "machine": "m", "load_after": 1.0, "model": "/x/demo",
        "prompt_tokens": 5, "new_tokens": 8, "repeats": 1, "link": "l",
    }  # fmt: skip
    text = table(results)
    assert "| 3 | 25 | corolla forwarding | 112.0 | 8.9 | 12.0 | 112.0 | 1.00 | 162.0 | NO |" in text
    assert "every connection to a server came through its proxy" in text


def test_unavailable_rows_are_reported_not_measured() -> None:
    rows = annotate([_row(2, 0.0, "spec_draft", None, [], error="no speculative decoding in this checkout")])
    assert rows[0]["floor_ms"] is None and rows[0]["tok_s"] is None
    results = {
        "rows": rows, "date_utc": "now", "machine": "m", "load_after": 1.0, "model": "/x/demo",
        "prompt_tokens": 5, "new_tokens": 8, "repeats": 1, "link": "l",
    }  # fmt: skip
    assert "n/a: no speculative decoding in this checkout" in table(results)


def test_arguments_and_full_grid() -> None:
    args = wan.parse_args(["--full"])
    assert args.server_counts == [2, 3, 4] and args.delay_list_ms == [5.0, 25.0, 75.0]
    assert wan.parse_args([]).server_counts == [3]
    with pytest.raises(SystemExit):
        wan.parse_args(["--modes", "teleport"])


def test_each_corolla_row_runs_the_client_it_names() -> None:
    configs = wan.client_configs()
    assert set(configs) == {"relaying", "forwarding"}
    assert not configs["relaying"].server_forwarding and configs["forwarding"].server_forwarding
    for config in configs.values():  # through the proxies (p2p), not the servers' local sockets
        assert not config.local_transport and config.max_retries == 3


def test_established_connections_are_read_from_proc() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    conn, _ = listener.accept()
    try:
        assert established_remote_ports(listener.getsockname()[1]) == [client.getsockname()[1]]
    finally:
        for s in (conn, client, listener):
            s.close()

"""`bench.handler_path` (the handler's per-step path in one process) runs sessions to the end and reports CPU and
wall time per decode step, also through a `ProxyExecutor` to an echo device process; bad sizes are refused."""

from __future__ import annotations

import pytest

from corolla.bench.handler_path import run_handler_path, session_messages


async def test_sessions_run_to_the_end_and_time_is_reported() -> None:
    result = await run_handler_path(sessions=3, steps=4)
    assert (result.sessions, result.steps) == (3, 4)
    assert 0 < result.cpu_us_per_step < 1e6 and 0 < result.wall_us_per_step < 1e6


async def test_sessions_run_through_a_proxy_executor_to_an_echo_device_process() -> None:
    result = await run_handler_path(sessions=2, steps=3, proxy=True)  # replies checked: none may be an error
    assert (result.sessions, result.steps) == (2, 3)
    assert 0 < result.cpu_us_per_step < 1e6 and 0 < result.wall_us_per_step < 1e6


def test_messages_are_a_prefill_then_one_token_steps() -> None:
    messages = session_messages(steps=2, seed=1)
    assert len(messages) == 3 and len(messages[0]) > len(messages[1]) == len(messages[2])


async def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        await run_handler_path(sessions=1, steps=0)


async def test_sessions_run_over_sockets_from_a_client_process_with_batched_device_replies() -> None:
    result = await run_handler_path(sessions=3, steps=4, proxy=True, sockets=True, forward_ms=1.0)
    assert (result.sessions, result.steps) == (3, 4)  # every decode reply reached its client, none an error
    assert 0 < result.cpu_us_per_step < 1e6 and 0 < result.wall_us_per_step < 1e6


async def test_sessions_run_over_sockets_without_a_device_process() -> None:
    result = await run_handler_path(sessions=2, steps=3, sockets=True)
    assert (result.sessions, result.steps) == (2, 3)


@pytest.mark.parametrize("framing", ["socket", "direct"])
async def test_sessions_run_over_the_endpoint_framings(framing: str) -> None:
    """The same-host socket's frames and the direct port's sealed frames, served by `stream_endpoint`: every decode
    reply reaches its client and none is an error (the bench raises otherwise)."""
    result = await run_handler_path(sessions=3, steps=4, proxy=True, sockets=True, forward_ms=1.0, framing=framing)
    assert (result.sessions, result.steps) == (3, 4)
    with pytest.raises(ValueError, match="needs sockets"):
        await run_handler_path(sessions=1, steps=1, framing=framing)


async def test_a_negative_forward_period_is_refused() -> None:
    with pytest.raises(ValueError, match="forward_ms >= 0"):
        await run_handler_path(sessions=1, steps=1, forward_ms=-1.0)

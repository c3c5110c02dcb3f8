"""The WAN emulator (benchmarks.wan_emulator): the shaper's schedule on a fake clock (delay bounds, order under jitter, bandwidth,
stalls) and the proxy on real loopback sockets (delay in both directions, byte order and content, bandwidth cap,
back-pressure bound, clean shutdown, config validation). Every wait is bounded."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from benchmarks.wan_emulator import LinkConfig, ProxyThread, WanProxy
from benchmarks.wan_emulator.__main__ import parse_args
from benchmarks.wan_emulator.shaper import Shaper
from helpers.ports import listening_port

# ---- shaper (pure, fake clock) ----------------------------------------------------------------------------------


def test_delay_and_jitter_stay_within_bounds() -> None:
    shaper = Shaper(LinkConfig(delay_ms=30, jitter_ms=10, seed=1))
    now = 0.0
    for _ in range(500):
        now += 0.1  # far apart: no chunk waits behind the one before it
        extra = shaper.release_time(100, now) - now
        assert 0.030 <= extra <= 0.040 + 1e-9


def test_jitter_never_reorders() -> None:
    shaper = Shaper(LinkConfig(delay_ms=5, jitter_ms=50, seed=2))
    releases = [shaper.release_time(10, i * 0.001) for i in range(1000)]  # arrivals 1 ms apart, jitter 50 ms
    assert releases == sorted(releases)
    assert all(r >= i * 0.001 + 0.005 for i, r in enumerate(releases))


def test_bandwidth_cap_sets_the_long_run_rate() -> None:
    shaper = Shaper(LinkConfig(bandwidth_bytes_per_s=1_000_000, burst_bytes=10_000))
    last = 0.0
    for _ in range(100):  # 100 x 50 kB all offered at t=0: 5 MB at 1 MB/s
        last = shaper.release_time(50_000, 0.0)
    assert last == pytest.approx(5.0 - 0.01, abs=1e-6)  # the first 10 kB ride the full bucket


def test_bucket_refills_while_idle() -> None:
    shaper = Shaper(LinkConfig(bandwidth_bytes_per_s=1000, burst_bytes=500))
    assert shaper.release_time(500, 0.0) == 0.0
    assert shaper.release_time(500, 0.0) == pytest.approx(0.5)
    assert shaper.release_time(400, 10.0) == 10.0  # refilled (to the bucket size only)
    assert shaper.release_time(200, 10.0) == pytest.approx(10.1)


def test_large_chunks_alone_take_the_extra_delay() -> None:
    shaper = Shaper(LinkConfig(delay_ms=10, large_bytes=8192, large_bytes_per_s=16384))
    assert shaper.release_time(1000, 0.0) == pytest.approx(0.010)
    assert shaper.release_time(8192, 1.0) == pytest.approx(1.510)  # half a second for its 8 KB
    assert shaper.release_time(100, 1.001) == pytest.approx(1.510)  # behind it: order holds
    assert shaper.release_time(100, 3.0) == pytest.approx(3.010)


def test_stall_holds_the_direction_behind_it() -> None:
    shaper = Shaper(LinkConfig(delay_ms=10, stall_probability=1.0, stall_ms=300, seed=3))
    assert shaper.release_time(10, 0.0) == pytest.approx(0.310)
    shaper.set_config(LinkConfig(delay_ms=10))
    assert shaper.release_time(10, 0.001) == pytest.approx(0.310)  # waits behind the stalled chunk
    assert shaper.stalls == 1
    counts = Shaper(LinkConfig(stall_probability=0.25, seed=4))
    for i in range(4000):
        counts.release_time(1, float(i))
    assert 800 < counts.stalls < 1200


@pytest.mark.parametrize(
    "kwargs",
    [
        {"delay_ms": -1},
        {"jitter_ms": 1e9},
        {"bandwidth_bytes_per_s": 0},
        {"stall_probability": 1.5},
        {"max_in_flight_bytes": 10},
        {"chunk_bytes": 0},
    ],
)
def test_bad_config_is_a_value_error_naming_the_limit(kwargs: dict) -> None:
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        LinkConfig(**kwargs)


def test_cli_parses_units_and_rejects_bad_addresses() -> None:
    args = parse_args(["--listen", "127.0.0.1:0", "--target", "127.0.0.1:4000", "--delay_ms", "25"])
    assert args.target == ("127.0.0.1", 4000) and args.delay_ms == 25.0
    with pytest.raises(SystemExit):
        parse_args(["--target", "nohostport"])


# ---- proxy on loopback sockets ------------------------------------------------------------------------------


async def _echo_server() -> asyncio.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.write_eof()
        finally:
            writer.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0)


def test_round_trip_crosses_the_delay_twice_with_bytes_intact() -> None:
    async def go() -> None:
        echo = await _echo_server()
        async with (
            echo,
            WanProxy(target_port=listening_port(echo), config=LinkConfig(delay_ms=40, jitter_ms=20)) as proxy,
        ):
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            payload = os.urandom(300_000)
            start = time.perf_counter()
            writer.write(payload[:10])
            await writer.drain()
            assert await asyncio.wait_for(reader.readexactly(10), 5) == payload[:10]
            rtt = time.perf_counter() - start
            assert 0.080 <= rtt < 0.080 + 0.040 + 0.5  # two one-way delays; jitter and a loaded CPU on top
            writer.write(payload[10:])  # many chunks with jitter: order and content must survive
            writer.write_eof()
            echoed = await asyncio.wait_for(reader.read(), 10)  # to EOF: the half-close crossed both ways
            assert echoed == payload[10:]
            writer.close()
            assert proxy.stats.bytes_to_target == proxy.stats.bytes_from_target == len(payload)

    asyncio.run(asyncio.wait_for(go(), 30))


def test_bandwidth_cap_limits_throughput() -> None:
    async def go() -> None:
        echo = await _echo_server()
        config = LinkConfig(bandwidth_bytes_per_s=400_000, burst_bytes=16_384, chunk_bytes=16_384)
        async with echo, WanProxy(target_port=listening_port(echo), config=config) as proxy:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            start = time.perf_counter()
            writer.write(b"x" * 200_000)
            writer.write_eof()
            data = await asyncio.wait_for(reader.read(), 10)
            elapsed = time.perf_counter() - start
            writer.close()
            assert len(data) == 200_000
            assert elapsed >= 0.45  # ~0.5 s each way, pipelined: at least 200 kB / 400 kB/s less one bucket

    asyncio.run(asyncio.wait_for(go(), 30))


def test_stalls_delay_the_stream() -> None:
    async def go() -> None:
        echo = await _echo_server()
        config = LinkConfig(stall_probability=1.0, stall_ms=150, seed=5)
        async with echo, WanProxy(target_port=listening_port(echo), config=config) as proxy:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            start = time.perf_counter()
            writer.write(b"ping")
            assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
            assert time.perf_counter() - start >= 0.3  # stalled once each way
            assert proxy.stats.stalls == 0  # counted when the connection ends
            writer.close()
        assert proxy.stats.stalls >= 2

    asyncio.run(asyncio.wait_for(go(), 30))


def test_back_pressure_bounds_what_a_direction_holds() -> None:
    async def go() -> None:
        accepted: list[asyncio.StreamReader] = []
        release = asyncio.Event()

        async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(reader)
            await release.wait()  # reads nothing: the target's receive window and the proxy must fill up
            while await reader.read(65536):
                pass
            writer.close()

        target = await asyncio.start_server(sink, "127.0.0.1", 0)
        config = LinkConfig(max_in_flight_bytes=64 * 1024, chunk_bytes=16 * 1024)
        async with target, WanProxy(target_port=listening_port(target), config=config) as proxy:
            _, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            block = b"y" * (1 << 20)
            sent = 0
            with pytest.raises(asyncio.TimeoutError):
                for _ in range(64):  # 64 MiB offered; the sender must block long before that
                    writer.write(block)
                    await asyncio.wait_for(writer.drain(), 1.0)
                    sent += len(block)
            assert sent < 32 << 20
            assert proxy.stats.max_in_flight_bytes <= config.max_in_flight_bytes + config.chunk_bytes
            release.set()
            writer.close()

    asyncio.run(asyncio.wait_for(go(), 30))


def test_unreachable_target_closes_the_connection() -> None:
    async def go() -> None:
        probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        dead_port = listening_port(probe)
        probe.close()
        await probe.wait_closed()
        async with WanProxy(target_port=dead_port, config=LinkConfig(delay_ms=5)) as proxy:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
            assert proxy.stats.connections == 0

    asyncio.run(asyncio.wait_for(go(), 30))


def test_proxy_thread_shuts_down_cleanly_with_open_connections() -> None:
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    conns: list[socket.socket] = []
    acceptor = threading.Thread(target=lambda: conns.append(listener.accept()[0]), daemon=True)
    acceptor.start()
    with ProxyThread() as wan:
        proxy = wan.add(listener.getsockname()[1], LinkConfig(delay_ms=20))
        client = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        client.sendall(b"hello")
        acceptor.join(5)
        conns[0].settimeout(5)
        assert conns[0].recv(5) == b"hello"
        wan.set_config(LinkConfig(delay_ms=1))
        assert proxy.config.delay_ms == 1
        port = proxy.port
    # closed: the connection ended on both sides, the thread is gone and the port is free again
    assert not wan._thread.is_alive()
    assert client.recv(10) == b""
    assert conns[0].recv(10) == b""
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2)
    for s in (client, conns[0], listener):
        s.close()


# ---- faults on demand: stall, drop, partition, heal; asymmetric bandwidth ------------------------------------------


async def _round_trip_s(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes) -> float:
    start = time.perf_counter()
    writer.write(payload)
    await writer.drain()
    assert await asyncio.wait_for(reader.readexactly(len(payload)), 10) == payload
    return time.perf_counter() - start


def test_stall_holds_every_byte_then_delivers_all_in_order() -> None:
    async def go() -> None:
        echo = await _echo_server()
        async with echo, WanProxy(target_port=listening_port(echo)) as proxy:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            assert await _round_trip_s(reader, writer, b"warm") < 0.5
            proxy.stall(0.6)
            assert 0.55 <= await _round_trip_s(reader, writer, b"held-" * 1000) < 3.0
            assert await _round_trip_s(reader, writer, b"after") < 0.5  # the stall ended
            assert proxy.stats.faults == 1
            writer.close()

    asyncio.run(asyncio.wait_for(go(), 30))


def test_drop_resets_connections_and_leaves_new_dials_unanswered_until_it_ends() -> None:
    async def go() -> None:
        echo = await _echo_server()
        async with echo, WanProxy(target_port=listening_port(echo)) as proxy:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            assert await _round_trip_s(reader, writer, b"warm") < 0.5
            proxy.drop(0.8)
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
                await asyncio.wait_for(reader.readexactly(1), 5)  # reset, not a clean end
            assert proxy.stats.resets == 1
            start = time.perf_counter()
            reader2, writer2 = await asyncio.open_connection("127.0.0.1", proxy.port)
            await _round_trip_s(reader2, writer2, b"again")
            assert time.perf_counter() - start >= 0.7  # the dial got through only once the drop ended
            for w in (writer, writer2):
                w.close()

    asyncio.run(asyncio.wait_for(go(), 30))


def test_partition_cuts_only_the_chosen_peers_until_healed() -> None:
    async def go() -> None:
        echo = await _echo_server()
        async with echo, WanProxy(target_port=listening_port(echo)) as proxy:
            cut_reader, cut_writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            ok_reader, ok_writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            assert await _round_trip_s(cut_reader, cut_writer, b"warm") < 0.5
            proxy.partition({int(cut_writer.get_extra_info("sockname")[1])})
            cut_writer.write(b"lost?")
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(cut_reader.readexactly(5), 0.5)
            assert await _round_trip_s(ok_reader, ok_writer, b"other peer") < 0.5  # not partitioned from it
            proxy.heal()
            assert await asyncio.wait_for(cut_reader.readexactly(5), 5) == b"lost?"  # held, then delivered
            proxy.partition()  # everyone
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(_round_trip_s(ok_reader, ok_writer, b"x"), 0.5)
            proxy.heal()
            for w in (cut_writer, ok_writer):
                w.close()

    asyncio.run(asyncio.wait_for(go(), 30))


def test_reply_bandwidth_caps_only_the_direction_from_the_server() -> None:
    config = LinkConfig(bandwidth_bytes_per_s=10_000_000, reply_bandwidth_bytes_per_s=1000, burst_bytes=100)
    assert config.for_direction(to_target=True) is config
    reply = config.for_direction(to_target=False)
    assert reply.bandwidth_bytes_per_s == 1000
    up, down = Shaper(config.for_direction(to_target=True)), Shaper(reply)
    assert up.release_time(1100, 0.0) == pytest.approx(0.0001)
    assert down.release_time(1100, 0.0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="reply_bandwidth_bytes_per_s"):
        LinkConfig(reply_bandwidth_bytes_per_s=0)


def test_fault_durations_are_bounded() -> None:
    from benchmarks.wan_emulator.faults import LinkFaults

    faults = LinkFaults()
    for bad in (0.0, -1.0, 1e9):
        with pytest.raises(ValueError, match="duration_s"):
            faults.stall(0.0, bad)
    with pytest.raises(ValueError, match="peer ports"):
        faults.partition({0})

"""The server lifecycle: resolve settings (device, dtype, quantization, limits, cache budget, throughput), join the
swarm, choose blocks, load them, serve them (`SpanService`: runtime + handler on a P2P replica, one asyncio loop),
check the swarm balance and move when it should, restart the serving part if it crashes, and on stop drain (the
core's drain started, OFFLINE announced, open sessions given `drain_timeout_s` to move: `drain_sessions`), end
sessions, free memory and leave no process behind."""

from __future__ import annotations

import asyncio
import gc
import random
import threading
import time
from typing import Any

import torch

from corolla import PETALS_COMPAT_VERSION
from corolla.engine.serving import SpanTraits
from corolla.models.config import is_local_path, load_config
from corolla.models.registry import get_family
from corolla.protocol.codecs import compression_from_name
from corolla.protocol.local_stream import socket_dir
from corolla.protocol.records import ModelInfo, ServerInfo, ServerState
from corolla.protocol.uids import make_uid
from corolla.server import startup_checks
from corolla.server.announcer import Announcer
from corolla.server.backend import SpanBackend
from corolla.server.block_loading import fetch_span_blocks, load_span_blocks
from corolla.server.config import ServerConfig, busy_poll_s, ignored_flags
from corolla.server.core.engine_executor import EngineExecutor, build_engine_executor
from corolla.server.core.limits import SessionTimeouts
from corolla.server.core.runtime import Runtime
from corolla.server.core.span_core import SpanCore
from corolla.server.front.block_functions import ServingLimits
from corolla.server.front.front_settings import FrontSettings
from corolla.server.metrics import MetricsExporter, ServerMetrics
from corolla.server.settings import ResolvedSettings, describe_settings, resolve_settings
from corolla.server.slowdown import BlockDelay, block_delay_s, slowed_throughput
from corolla.server.span_service import SpanService
from corolla.server.swarm_seat import SwarmSeat
from corolla.server.throughput import get_server_throughput
from corolla.swarm.dht import SwarmConfig, create_dht, get_peer_id, get_visible_maddrs, shutdown_dht
from corolla.swarm.local import ready_line
from corolla.swarm.membership import SwarmKeyAuthorizer, load_swarm_key
from corolla.swarm.policy import FETCH_CHECKS_PER_PERIOD
from corolla.swarm.reachability import attach_reachability_protocol, check_direct_reachability, validate_reachability
from corolla.utils import busy_poll
from corolla.utils.errors import ConfigurationError
from corolla.utils.logging import get_logger
from corolla.utils.long_lived import freeze_long_lived, thaw_long_lived

logger = get_logger(__name__)

MAX_CONSECUTIVE_FAILURES = 5
DRAIN_POLL_S = 0.02


class Server:
    """One server process. `run()` blocks until stopped (SIGINT/SIGTERM via `request_stop()`); `start()` runs the
    same loop in a background thread (for in-process tests) and waits until it serves."""

    def __init__(self, config: ServerConfig):
        self.config = config
        # device and quantization first (no model needed): a setting that cannot run here ends in seconds
        device, quant_type = startup_checks.resolve_device_and_quant(
            config.device, config.quant_type, config.tensor_parallel_devices
        )
        self.model_config = load_config(
            config.model_name_or_path, revision=config.revision, token=config.token, cache_dir=config.cache_dir
        )
        self.family = get_family(self.model_config)
        quant_type = startup_checks.checkpoint_quant_type(config.quant_type, quant_type, self.model_config)
        self.settings = resolve_settings(config, self.model_config, device, quant_type)
        dtype, dht_prefix, total_blocks = self.settings.dtype, self.settings.dht_prefix, self.settings.total_blocks
        self.module_uids = [make_uid(dht_prefix, i) for i in range(total_blocks)]
        self.compression = compression_from_name(config.compression)
        if config.compression == "FLOAT16" and dtype == torch.bfloat16:
            raise ValueError("--compression FLOAT16 can't carry bfloat16 outputs; use NONE or MEANSTD_16BIT")
        self.timeouts = SessionTimeouts(config.step_timeout_s, config.session_timeout_s, config.request_timeout_s)
        self.dht: Any = None
        self.throughput_info: dict[str, float] = {}
        self.using_relay = bool(config.reachable_via_relay)
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        # the serving loop's selector (set when it starts): polls instead of sleeping only when a lone session's step
        # just ran inline and its next request is due (`busy_poll_ms`)
        self.selector: busy_poll.BusyPollSelector | None = None
        self._async_stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._shutdown_done = False
        self.block_indices: range | None = None
        self.peer_id: str | None = None
        self.join_maddrs: list[str] = []
        self.service: SpanService | None = None
        self.announcer: Announcer | None = None
        self.seat: SwarmSeat | None = None  # placement and moves by the swarm policy (after the DHT is up)
        self.num_restarts = 0
        self._reachability_service: Any = None
        self.metrics = ServerMetrics()
        self.ping_authorizer: Any = None  # signs the announcer's pings in a private swarm (members refuse others)
        self.metrics_exporter: MetricsExporter | None = None
        self._validated_reachability = False

    # ---- settings ---------------------------------------------------------------------------------------------

    def describe(self) -> str:
        return describe_settings(self.settings, self.config)

    def measure_throughput(self) -> dict[str, float]:
        c, s = self.config, self.settings
        if block_delay_s() is not None:  # test-only: announce what the emulated slower device would measure
            return slowed_throughput(block_delay_s() or 0.0, s.num_blocks)
        if not isinstance(c.throughput, str):
            return {"throughput": float(c.throughput)}
        tp_devices = [torch.device(d) for d in c.tensor_parallel_devices or ()]
        return get_server_throughput(
            c.model_name_or_path,
            self.model_config,
            s.device,
            s.dtype,
            num_blocks=s.num_blocks,
            quant_type=s.quant_type,
            tensor_parallel_devices=tp_devices,
            using_relay=self.using_relay,
            public_swarm=not c.is_private_swarm,
            force_eval=c.throughput in ("eval", "dry_run"),
            cache_dir=c.cache_dir,
            forward_tokens=c.throughput_forward_tokens,
        )

    # ---- entry points -----------------------------------------------------------------------------------------

    def run(self) -> int:
        """Measures/reads throughput, joins the swarm and serves until `request_stop()`. Returns an exit code."""
        logger.info(f"server.settings({self.describe()})")
        ignored = ignored_flags(self.config)
        if ignored:
            logger.info(f"server.ignored_flags({', '.join(ignored)}): accepted for Petals compatibility, no effect")
        if self.config.throughput == "dry_run":
            info = self.measure_throughput()
            print("corolla-server: throughput " + " ".join(f"{k}={v:.3f}" for k, v in sorted(info.items())), flush=True)
            return 0
        self._prepare()
        self.selector = busy_poll.BusyPollSelector()
        return busy_poll.run(self._main(), self.selector)

    def start(self, timeout_s: float = 120.0) -> Server:
        """Runs the server in a background thread (DHT created in the calling thread) and waits until it serves."""
        self._prepare()
        result: dict[str, Any] = {}

        def target() -> None:
            try:
                self.selector = busy_poll.BusyPollSelector()
                result["code"] = busy_poll.run(self._main(), self.selector)
            except BaseException as e:  # surfaced by wait_ready
                result["error"] = e
                self._ready.set()

        self._thread = threading.Thread(target=target, name="corolla-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or "error" in result:
            self.shutdown()
            raise RuntimeError(f"server did not become ready within {timeout_s} s: {result.get('error')!r}")
        return self

    def request_stop(self) -> None:
        """Signal-safe: asks the serving loop to announce OFFLINE, end sessions and return."""
        self._stop.set()
        loop, event = self._loop, self._async_stop
        if loop is not None and event is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:
                pass

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stops serving (if running in a thread) and the DHT; idempotent."""
        if self._shutdown_done:
            return
        self._shutdown_done = True
        self.request_stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        if self.metrics_exporter is not None:
            self.metrics_exporter.close()
            self.metrics_exporter = None
        if self._reachability_service is not None:
            self._reachability_service.shutdown()
            self._reachability_service = None
        if self.dht is not None:
            shutdown_dht(self.dht)
            self.dht = None
        logger.info("server.shutdown_done")

    # ---- internals --------------------------------------------------------------------------------------------

    def _prepare(self) -> None:
        c = self.config
        public = not c.is_private_swarm
        swarm_config = SwarmConfig(
            initial_peers=c.resolved_initial_peers,
            host_maddrs=c.resolved_host_maddrs,
            announce_maddrs=c.resolved_announce_maddrs,
            identity_path=c.identity_path,
            use_relay=public,
            use_auto_relay=public and c.use_auto_relay,
            nat_port_map=public,
            auto_nat=public,
            startup_timeout_s=c.daemon_startup_timeout_s,
            num_workers=max(1, min(self.settings.total_blocks, 32)),
            swarm_key=load_swarm_key(c.swarm_key_file),
        )
        if public and c.reachable_via_relay is None:
            # unreachable directly -> relays, a client-mode DHT and the relay throughput penalty (unknown -> direct)
            self.using_relay = self._check_reachability(swarm_config)
        swarm_config.client_mode = self.using_relay
        self.dht = create_dht(swarm_config)  # before threads and CUDA: hivemind forks
        self.peer_id = get_peer_id(self.dht).to_base58()
        self.ping_authorizer = None if swarm_config.swarm_key is None else SwarmKeyAuthorizer(swarm_config.swarm_key)
        self.join_maddrs = get_visible_maddrs(self.dht)
        logger.info(f"server.dht_ready(peer_id={self.peer_id}, maddrs={' '.join(self.join_maddrs)})")
        if public and not self.using_relay:
            try:  # lets other joining servers ask us whether they are reachable
                self._reachability_service = attach_reachability_protocol(self.dht)
            except Exception as e:
                logger.warning(f"server.reachability_protocol_failed({e!r})")
        if c.metrics_port is not None:
            self.metrics_exporter = self.metrics.serve(c.metrics_port)
            print(f"corolla-server: metrics at {self.metrics_exporter.url}", flush=True)
        if c.new_swarm:
            print(
                f"corolla-server: new swarm, others join with --initial_peers {' '.join(self.join_maddrs)}", flush=True
            )
        self.throughput_info = self.measure_throughput()
        logger.info(f"server.throughput({', '.join(f'{k}={v:.1f}' for k, v in sorted(self.throughput_info.items()))})")
        self.seat = SwarmSeat(
            dht=self.dht, module_uids=self.module_uids, max_blocks=self.settings.num_blocks,
            throughput_info=self.throughput_info, metrics=self.metrics,
            cache_tokens_per_block=self.settings.cache_bytes_per_block // self.settings.kv_bytes_per_token_block,
        )  # fmt: skip
        self.seat.peer_id = self.peer_id

    def _check_reachability(self, swarm_config: Any) -> bool:
        """Public swarm only: True if we must go through relays. Unknown -> assume directly reachable."""
        try:
            result = check_direct_reachability(swarm_config)
        except Exception as e:
            logger.warning(f"server.reachability_check_failed({e!r})")
            return False
        logger.info(f"server.reachability(direct={result})")
        return result is False

    def _make_server_info(self, block_indices: range) -> ServerInfo:
        s, seat = self.settings, self.seat
        rps = self.throughput_info
        return ServerInfo(
            state=ServerState.JOINING,
            throughput=seat.throughput_for(block_indices) if seat else float(rps.get("throughput", 1.0)),
            public_name=self.config.public_name,
            version=PETALS_COMPAT_VERSION,
            adapters=tuple(self.config.adapters),
            torch_dtype=str(s.dtype).removeprefix("torch."),
            quant_type=s.quant_type,
            using_relay=self.using_relay,
            network_rps=rps.get("network_rps"),
            forward_rps=rps.get("forward_rps"),
            inference_rps=rps.get("inference_rps"),
        )

    def _model_info(self) -> ModelInfo:
        name = self.config.model_name_or_path
        repository = None if is_local_path(name) else f"https://huggingface.co/{name}"
        return ModelInfo(num_blocks=self.settings.total_blocks, repository=repository)

    async def _main(self) -> int:
        self._loop = asyncio.get_running_loop()
        self._async_stop = asyncio.Event()
        if self._stop.is_set():
            return 0
        p2p = await self.dht.replicate_p2p()
        failures = 0
        try:
            while not self._stop.is_set():
                try:
                    outcome = await self._serve_once(p2p)
                    failures = 0
                except ConfigurationError:
                    raise  # cannot work here (no checkpoint, bitsandbytes missing, ...): retrying would not help
                except Exception as e:
                    failures += 1
                    self.num_restarts += 1
                    logger.exception(f"server.serving_failed(attempt={failures}): {e!r}")
                    if failures >= MAX_CONSECUTIVE_FAILURES:
                        return 1
                    await self._sleep(min(2.0**failures, 30.0))
                    continue
                if outcome == "stop":
                    break
                if outcome == "crashed":
                    self.num_restarts += 1
                    logger.warning("server.restart(reason=serving part crashed)")
        finally:
            self._ready.set()
            try:
                await asyncio.wait_for(p2p.shutdown(), 5.0)
            except Exception as e:
                logger.debug(f"server.p2p_replica_shutdown_failed({e!r})")
        return 0

    async def _sleep(self, seconds: float) -> bool:
        """Sleeps unless stopped first; True if a stop was requested."""
        assert self._async_stop is not None
        try:
            await asyncio.wait_for(self._async_stop.wait(), max(seconds, 0.0))
            return True
        except asyncio.TimeoutError:
            return self._stop.is_set()

    async def _choose_blocks(self) -> range:
        c = self.config
        if c.block_indices is not None:
            return range(*c.block_indices)
        if self.seat is not None and self.seat.next_span is not None:  # a move: the span it fetched, at once
            return await self.seat.choose_span()
        if await self._sleep(random.uniform(0, 2 * c.mean_block_selection_delay_s)):
            raise asyncio.CancelledError
        assert self.seat is not None
        return await self.seat.choose_span()

    async def _serve_once(self, p2p: Any) -> str:
        """Chooses, loads and serves one span until stop ("stop"), a crash ("crashed") or a move ("move")."""
        c, s = self.config, self.settings
        try:
            block_indices = await self._choose_blocks()
        except asyncio.CancelledError:
            if self._stop.is_set():
                return "stop"
            raise
        self.block_indices = block_indices
        announcer = Announcer(
            dht=self.dht,
            dht_prefix=s.dht_prefix,
            block_indices=block_indices,
            total_blocks=s.total_blocks,
            server_info=self._make_server_info(block_indices),
            model_info=self._model_info(),
            cache_tokens_left=self._cache_tokens_left,
            load=lambda: self.seat.load_fields(self.service) if self.seat else {},
            # the test-only slowdown announces the slower device's figures (`slowed_throughput`): its steps' own
            # times are this device's, so they do not replace them
            rates=self._step_rates if block_delay_s() is None else None,
            update_period_s=c.update_period_s,
            expiration_s=c.resolved_expiration_s,
            p2p=p2p,
            local_peer_id=self.peer_id,
            ping_authorizer=self.ping_authorizer,
            on_failure=self.metrics.announce_failed,
        )
        self.announcer = announcer
        announcer.start(ServerState.JOINING)
        service: SpanService | None = None
        executor: EngineExecutor | None = None
        try:
            logger.info(f"server.loading(blocks={block_indices.start}:{block_indices.stop})")
            load_started = time.monotonic()
            blocks = await asyncio.to_thread(load_span_blocks, self.config, self.model_config, block_indices,
                                             dtype=s.dtype, device=s.device, quant_type=s.quant_type)  # fmt: skip
            backend = SpanBackend(
                blocks,
                config=self.model_config,
                dtype=s.dtype,
                device=s.device,
                max_chunk_size_bytes=c.max_chunk_size_bytes,
                adapters=c.adapters,
            )
            del blocks
            if self._stop.is_set():  # stopped while loading: never go ONLINE
                return "stop"
            executor = await asyncio.to_thread(executor_for_span, c, s, self.family.family, backend,
                                               s.cache_bytes_per_block * len(block_indices), self.metrics)  # fmt: skip
            del backend
            limits = ServingLimits(
                dht_prefix=s.dht_prefix, start_block=block_indices.start, end_block=block_indices.stop,
                hidden_size=s.hidden_size, dtype=s.dtype, inference_max_length_tokens=s.inference_max_length_tokens,
                max_batch_size_tokens=s.max_batch_size_tokens, adapters=tuple(c.adapters),
            )  # fmt: skip
            poll_s = busy_poll_s(c.busy_poll_ms, s.device.type)  # 0 on a CPU server
            settings = FrontSettings(
                limits, self.timeouts, c.peer_limits, self.compression, dht_client_mode=self.using_relay,
                swarm_key_file=c.swarm_key_file, kv_handoff=c.kv_handoff, prefix_cache_shared=c.prefix_cache_shared,
                local_socket_dir=str(socket_dir()) if c.local_socket else None, direct=c.resolved_direct(),
                poll_linger_s=poll_s,  # handler processes poll this long after each message
            )  # fmt: skip
            service = SpanService(
                executor, settings, metrics=self.metrics, num_handlers=c.num_handlers,  # N > 1: handler processes
                busy_poll=self.selector if poll_s > 0 else None, busy_poll_s=poll_s,
            )  # fmt: skip
            c_public = not c.is_private_swarm
            if c_public and not c.skip_reachability_check and not self._validated_reachability:
                await asyncio.to_thread(validate_reachability, self.peer_id or "")
                self._validated_reachability = True
            if block_delay_s() is not None:  # test-only slowdown (server.slowdown)
                service.runtime.add_batch_observer(BlockDelay(block_delay_s() or 0.0, len(block_indices)))
            await service.start(p2p)
            self.service = service
            if self.seat is not None:
                self.seat.loaded(time.monotonic() - load_started)
            self.metrics.blocks_served(len(block_indices))
            self.metrics.set_cache(0, executor.max_size_bytes)
            await announcer.announce(ServerState.ONLINE)
            print(ready_line(str(self.peer_id), block_indices.start, block_indices.stop, self.join_maddrs), flush=True)
            logger.info(
                f"server.online(blocks={block_indices.start}:{block_indices.stop}, "
                f"throughput={announcer.server_info.throughput:.1f}, join={' '.join(self.join_maddrs)})"
            )
            frozen = freeze_long_lived()  # out of the collector's full passes while this span serves
            logger.info(f"server.heap_frozen(objects={frozen})")
            self._ready.set()
            return await self._watch(service)
        finally:
            if service is not None and service.healthy and c.drain_timeout_s > 0:  # stop or move: let sessions move
                await drain_sessions(service.core, announcer, c.drain_timeout_s)
            await announcer.announce(ServerState.OFFLINE)
            await announcer.stop()
            if service is not None:
                await service.stop()
            self.service = None
            del service, executor
            thaw_long_lived()  # the released span's cycles are the collector's again
            gc.collect()
            if s.device.type == "cuda":
                torch.cuda.empty_cache()
            logger.info(f"server.span_released(blocks={block_indices.start}:{block_indices.stop})")

    def _step_rates(self) -> dict[str, float | None]:
        """The step rates the span's engine measured from the steps it served (`server.core.step_rates`; none before
        it serves): announced in place of the start-up figures, which stay for placement (`throughput`)."""
        service = self.service
        return {} if service is None else service.executor.rates.announced()

    def _cache_tokens_left(self) -> int:
        """Announced cache_tokens_left (K or V of one token in one block): the whole budget until serving, then the
        room a session over the whole span can still get (clients read it so; decision 0036)."""
        s, service = self.settings, self.service
        if service is None:
            return s.cache_bytes_per_block * s.num_blocks // s.kv_bytes_per_token_block
        return service.executor.whole_span_bytes_left // s.kv_bytes_per_token_block

    async def _watch(self, service: SpanService) -> str:
        c = self.config
        last_report = time.monotonic()
        while True:
            wait_s = random.uniform(0, 2 * c.mean_balance_check_period_s)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:  # check health every second while waiting
                if await self._sleep(min(1.0, deadline - time.monotonic())):
                    return "stop"
                if not service.healthy:
                    return "crashed"
                if c.stats_report_interval_s and time.monotonic() - last_report >= c.stats_report_interval_s:
                    last_report = time.monotonic()
                    self._report_stats(service)
            target = await self._plan_move()
            if target is None:
                continue
            # keep serving this span while the new one's weights come to the disk, asking again at balance checks
            # during the fetch and at its end: the swarm may have changed meanwhile (what was fetched stays cached)
            assert self.seat is not None
            self.seat.fetch_started(target)
            await self._announce_move_phase()
            fetched = await self._fetch_while_serving(service, target)
            if fetched in ("stop", "crashed"):
                self.seat.fetch_ended(dropped=False)
                return fetched
            dropped = fetched == "dropped" or await self._plan_move() is None
            self.seat.fetch_ended(dropped=dropped)
            if dropped:
                logger.info(
                    f"server.move_dropped(blocks={target.start}:{target.stop}, during_fetch={fetched == 'dropped'})"
                )
                await self._announce_move_phase()
                continue
            self.seat.moving_to(target)
            logger.info(f"server.move(reason=swarm is imbalanced, blocks={target.start}:{target.stop})")
            return "move"

    async def _announce_move_phase(self) -> None:
        """Re-announces now (same state) so that the record's `moving_to` shows a fetch as it starts and ends."""
        if self.announcer is not None:
            await self.announcer.announce(self.announcer.state)

    @staticmethod
    def _report_stats(service: SpanService) -> None:
        runtime, executor = service.runtime, service.executor
        prefix = executor.prefix_cache_stats()
        logger.info(
            f"server.stats(path={executor.path}, tasks_done={runtime.num_tasks_done}, "
            f"batches_done={runtime.num_batches_done}, pending={runtime.num_pending}, "
            f"sessions={service.core.num_open}, "
            f"cache_used_bytes={executor.max_size_bytes - executor.bytes_left}, cache_left_bytes={executor.bytes_left}, "
            f"prefix_cached_bytes={prefix.cached_bytes}, prefix_evictions={prefix.evictions})"
        )

    async def _plan_move(self) -> range | None:
        c = self.config
        if c.block_indices is not None or c.balance_quality <= 0 or self.seat is None:
            return None
        return await self.seat.plan_move(rtts_s=self.announcer.rtts_s() if self.announcer else {})

    async def _fetch_while_serving(self, service: SpanService, target: range) -> str:
        """Fetches `target`'s checkpoint files to the disk in a daemon thread while `service` serves, the balance
        checks going on (`FETCH_CHECKS_PER_PERIOD` times as often): "fetched"; "dropped" when a check finds the move
        no longer wanted (the download stops before its next block: half the moves planned in the simulator were
        dropped at the fetch's end, minutes of a volunteer's bandwidth each); or "stop" / "crashed" if that comes
        first (a stopping server does not wait for a download)."""
        logger.info(f"server.fetching(blocks={target.start}:{target.stop})")
        started = time.monotonic()
        done, cancelled = threading.Event(), threading.Event()
        failure: list[BaseException] = []

        def fetch() -> None:
            try:
                fetch_span_blocks(self.config, self.model_config, target, cancelled)
            except BaseException as e:  # reported below; the move then loads (and downloads) as a join does
                failure.append(e)
            finally:
                done.set()

        threading.Thread(target=fetch, name="corolla-span-fetch", daemon=True).start()
        period_s = self.config.mean_balance_check_period_s / FETCH_CHECKS_PER_PERIOD
        check_at = time.monotonic() + random.uniform(0, 2 * period_s)
        try:
            while not done.is_set():
                if await self._sleep(0.2):
                    return "stop"
                if not service.healthy:
                    return "crashed"
                if time.monotonic() >= check_at and not done.is_set():
                    if await self._plan_move() is None:
                        logger.info(
                            f"server.fetch_stopped(blocks={target.start}:{target.stop}, "
                            f"seconds={time.monotonic() - started:.1f})"
                        )
                        return "dropped"
                    check_at = time.monotonic() + random.uniform(0, 2 * period_s)
        finally:
            cancelled.set()  # (after the last block: nothing left to stop)
        if failure:
            logger.warning(f"server.fetch_failed(blocks={target.start}:{target.stop}, error={failure[0]!r})")
        else:
            logger.info(
                f"server.fetched(blocks={target.start}:{target.stop}, seconds={time.monotonic() - started:.1f})"
            )
        return "fetched"


def executor_for_span(
    config: ServerConfig,
    settings: ResolvedSettings,
    family: str,
    backend: SpanBackend,
    cache_bytes: int,
    metrics: ServerMetrics | None,
) -> EngineExecutor:
    """A server's executor for its loaded span, on a new runtime, with a pool of `cache_bytes`."""
    traits = SpanTraits(
        device_type=settings.device.type,
        dtype=settings.dtype,
        quant_type=settings.quant_type,
        family=family,
        num_adapters=len(config.adapters),
        tensor_parallel_devices=len(config.tensor_parallel_devices or ()),
    )
    runtime = Runtime(max_batch_size_tokens=settings.max_batch_size_tokens, device=settings.device)
    return build_engine_executor(
        backend,
        runtime,
        traits,
        kv_pool_bytes=cache_bytes,
        max_seq_len_tokens=settings.inference_max_length_tokens,
        metrics=metrics,
        max_alloc_timeout_s=config.max_alloc_timeout_s,
        prefix_cache_tokens=config.prefix_cache_tokens,
    )


async def drain_sessions(core: SpanCore, announcer: Announcer, timeout_s: float) -> None:
    """Starts the core's drain (every front refuses new sessions and offers its sessions' KV to their clients) and
    announces OFFLINE (so no client plans new sessions here) while waiting up to `timeout_s` for the sessions open
    through any front to move away; then returns, and the caller ends whatever is left."""
    started = time.monotonic()
    core.drain.start(timeout_s)
    num_open = core.num_open
    logger.info(f"drain.start(sessions={num_open}, timeout_s={timeout_s})")
    offline = asyncio.ensure_future(announcer.announce(ServerState.OFFLINE))
    while core.num_open > 0 and time.monotonic() - started < timeout_s:
        await asyncio.sleep(DRAIN_POLL_S)
    await offline
    logger.info(
        f"drain.done(sessions_at_start={num_open}, left={core.num_open}, seconds={time.monotonic() - started:.2f})"
    )

"""Which executor serves a span, and why: `choose_serving_path` asks the engine what it supports
(`corolla.engine.serving.unsupported_reason`) under the server's `--serving_path auto|fast|plain`, and
`make_executor` builds the chosen one (logging the path and, for plain, the reason). The choice is reported in
the start-up log, the `corolla_serving_path{path}` gauge and `rpc_info`'s `serving_path` key."""

from __future__ import annotations

from dataclasses import dataclass

from corolla.engine.serving import SpanTraits, unsupported_reason
from corolla.server.backend import SpanBackend
from corolla.server.config import ServerConfig
from corolla.server.executor import PATH_FAST, PATH_PLAIN, DeviceExecutor
from corolla.server.memory_cache import MemoryCache
from corolla.server.metrics import ServerMetrics
from corolla.server.plain_executor import PlainExecutor
from corolla.server.runtime import Runtime
from corolla.server.settings import ResolvedSettings
from corolla.utils.errors import ConfigurationError
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

MODE_AUTO = "auto"
SERVING_PATH_MODES = (MODE_AUTO, PATH_FAST, PATH_PLAIN)


@dataclass(frozen=True)
class ServingPathChoice:
    """The path to build and why (for plain: what keeps the fast path out)."""

    path: str
    reason: str
    required: bool  # --serving_path fast: failing to build it ends the server instead of serving plain


def choose_serving_path(mode: str, traits: SpanTraits) -> ServingPathChoice:
    """auto: fast where the engine supports the span on CUDA (the CPU default stays plain); fast: the engine
    wherever it supports the span, CPU included (ConfigurationError if it can't); plain: always plain."""
    if mode not in SERVING_PATH_MODES:
        raise ValueError(f"serving_path must be one of {SERVING_PATH_MODES}, got {mode!r}")
    if mode == PATH_PLAIN:
        return ServingPathChoice(PATH_PLAIN, "--serving_path plain", required=False)
    reason = unsupported_reason(traits, allow_cpu=mode == PATH_FAST)
    if reason is None:
        return ServingPathChoice(PATH_FAST, "supported", required=mode == PATH_FAST)
    if mode == PATH_FAST:
        raise ConfigurationError(f"--serving_path fast can't serve this span: {reason}")
    return ServingPathChoice(PATH_PLAIN, reason, required=False)


@dataclass(frozen=True)
class ExecutorSettings:
    """What either executor needs besides the blocks."""

    cache_bytes: int  # KV budget (MemoryCache bytes or the engine's pool)
    max_seq_len_tokens: int  # longest session (inference_max_length)
    max_alloc_timeout_s: float | None
    tensor_parallel: bool
    warmup: bool = True  # the fast path captures its CUDA graphs before serving


def make_executor(
    choice: ServingPathChoice,
    backend: SpanBackend,
    runtime: Runtime,
    settings: ExecutorSettings,
    metrics: ServerMetrics | None = None,
) -> DeviceExecutor:
    """Builds the chosen executor. An auto-chosen fast path that fails to build (the engine refuses the blocks,
    device memory) serves plain, with the failure logged and named as the reason."""
    path, reason = choice.path, choice.reason
    if path == PATH_FAST:
        from corolla.server.fast_executor import build_fast_executor

        try:
            executor = build_fast_executor(
                backend,
                runtime,
                kv_pool_bytes=settings.cache_bytes,
                max_seq_len_tokens=settings.max_seq_len_tokens,
                metrics=metrics,
                max_alloc_timeout_s=settings.max_alloc_timeout_s,
                warmup=settings.warmup,
            )
        except Exception as e:
            if choice.required:
                raise ConfigurationError(f"--serving_path fast: the engine could not be built: {e}") from e
            logger.warning(f"serving_path.fast_build_failed(error={e!r})")
            path, reason = PATH_PLAIN, f"fast path build failed: {e}"
        else:
            _report(PATH_FAST, reason, metrics)
            return executor
    memory_cache = MemoryCache(settings.cache_bytes, settings.max_alloc_timeout_s)
    _report(PATH_PLAIN, reason, metrics)
    return PlainExecutor(backend, memory_cache, runtime, metrics, tensor_parallel=settings.tensor_parallel)


def _report(path: str, reason: str, metrics: ServerMetrics | None) -> None:
    logger.info(f"server.serving_path(path={path}, reason={reason!r})")
    if metrics is not None:
        metrics.serving_path(path)


def executor_for_span(
    config: ServerConfig,
    settings: ResolvedSettings,
    family: str,
    backend: SpanBackend,
    cache_bytes: int,
    metrics: ServerMetrics | None,
) -> DeviceExecutor:
    """A server's executor for its loaded span, on a new runtime: `--serving_path` (and `--no_fast_path`, which
    means plain) against what the engine supports."""
    tp_devices = len(config.tensor_parallel_devices or ())
    traits = SpanTraits(
        device_type=settings.device.type,
        dtype=settings.dtype,
        quant_type=settings.quant_type,
        family=family,
        num_adapters=len(config.adapters),
        tensor_parallel_devices=tp_devices,
    )
    choice = choose_serving_path(config.serving_path if config.fast_path else PATH_PLAIN, traits)
    runtime = Runtime(max_batch_size_tokens=settings.max_batch_size_tokens, device=settings.device)
    executor_settings = ExecutorSettings(
        cache_bytes=cache_bytes,
        max_seq_len_tokens=settings.inference_max_length_tokens,
        max_alloc_timeout_s=config.max_alloc_timeout_s,
        tensor_parallel=tp_devices > 1,
    )
    return make_executor(choice, backend, runtime, executor_settings, metrics)

"""Server throughput (reference section 5): measure single-token inference and many-token forward speed of one random
block on the real device, take the network speed (speedtest only for the public swarm), cache the raw figures in a
JSON file keyed by model, device and dtype (under a file lock), and derive the figure to announce."""

from __future__ import annotations

import fcntl
import functools
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeGuard

import torch

from corolla.models.block_base import CorollaBlock
from corolla.models.placement import place_block
from corolla.models.registry import get_family
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

CACHE_FILE_NAME = "throughput_v1.json"
LOCK_FILE_NAME = "throughput.lock"
DEFAULT_NETWORK_SPEED_BITS_PER_S = 100e6  # assumed for private swarms and when speedtest fails
RELAY_PENALTY = 0.2
INFERENCE_STEPS = 100
FORWARD_STEPS = 10
FORWARD_TOKENS_ACCELERATOR = 1024
# On CPU the 1024-token forward of a real block takes long; the figure is tokens/s so a shorter input stays comparable.
FORWARD_TOKENS_CPU = 128
INFERENCE_STEPS_CPU = 20
FORWARD_STEPS_CPU = 3


def default_cache_dir() -> Path:
    return Path(os.environ.get("COROLLA_CACHE", Path.home() / ".cache" / "corolla"))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} GPU"
    return device.type.upper()


def dtype_name(dtype: torch.dtype, quant_type: str) -> str:
    name = str(dtype).replace("torch.", "")
    if quant_type not in ("none", ""):
        name += f", quantized to {quant_type}"
    return name


def cache_key(
    model_name: str,
    device: torch.device,
    dtype: torch.dtype,
    quant_type: str,
    tensor_parallel_devices: Sequence[torch.device] = (),
) -> str:
    key = f"model_{model_name}_device_{device_name(device).replace(' ', '_')}_dtype_{dtype_name(dtype, quant_type)}"
    if len(tensor_parallel_devices) > 1:
        for i, tp_device in enumerate(tensor_parallel_devices):
            key += f"_tp{i}_{device_name(tp_device).replace(' ', '_')}"
    return key


def derive_throughput(info: dict[str, float], *, num_blocks: int, using_relay: bool) -> float:
    """Tokens/s this server adds to the swarm: a request enters at a random block and uses (n+1)/2 blocks on average."""
    network = info["network_rps"] * (RELAY_PENALTY if using_relay else 1.0)
    return float(min(info["forward_rps"] / ((num_blocks + 1) / 2), network))


def get_server_throughput(
    model_name: str,
    config: Any,
    device: torch.device,
    dtype: torch.dtype,
    *,
    num_blocks: int,
    quant_type: str = "none",
    tensor_parallel_devices: Sequence[torch.device] = (),
    using_relay: bool = False,
    public_swarm: bool = False,
    force_eval: bool = False,
    cache_dir: str | os.PathLike | None = None,
    forward_tokens: int | None = None,
) -> dict[str, float]:
    """Returns `{"throughput", "inference_rps", "forward_rps", "network_rps"}` (all floats, tokens/s), measuring
    only if `force_eval` or no cached figures exist for this model/device/dtype."""
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    key = cache_key(model_name, device, dtype, quant_type, tensor_parallel_devices)
    cache_path = directory / CACHE_FILE_NAME
    with open(directory / LOCK_FILE_NAME, "w") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)  # one measurement per host at a time
        try:
            cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
            if not isinstance(cache, dict):
                cache = {}
        except (OSError, ValueError) as e:
            logger.warning(f"throughput.cache_unreadable(path={cache_path}): {e!r}; measuring again")
            cache = {}
        cached = cache.get(key)
        if force_eval or not _valid_figures(cached):
            info = measure_throughput_info(
                config, device, dtype, quant_type=quant_type, tensor_parallel_devices=tensor_parallel_devices,
                public_swarm=public_swarm, forward_tokens=forward_tokens,
            )  # fmt: skip
            cache[key] = info
            tmp_path = cache_path.with_suffix(".tmp")
            tmp_path.write_text(json.dumps(cache, indent=2, sort_keys=True))
            tmp_path.replace(cache_path)
            logger.info(f"throughput.measured(key={key}, cache={cache_path})")
        else:
            info = dict(cached)
            logger.info(f"throughput.cached(key={key}, cache={cache_path})")
    result = {name: float(info[name]) for name in ("inference_rps", "forward_rps", "network_rps")}
    result["throughput"] = derive_throughput(result, num_blocks=num_blocks, using_relay=using_relay)
    logger.info(f"throughput.report(throughput={result['throughput']:.1f} tokens/s, num_blocks={num_blocks})")
    return result


def _valid_figures(cached: object) -> TypeGuard[dict[str, float]]:
    """Whether a cache entry holds the three positive, finite figures (it came from a file anyone can edit)."""
    if not isinstance(cached, dict):
        return False
    for name in ("inference_rps", "forward_rps", "network_rps"):
        value = cached.get(name)
        if not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
            return False
    return True


def measure_throughput_info(
    config: Any,
    device: torch.device,
    dtype: torch.dtype,
    *,
    quant_type: str = "none",
    tensor_parallel_devices: Sequence[torch.device] = (),
    public_swarm: bool = False,
    forward_tokens: int | None = None,
) -> dict[str, float]:
    on_cpu = device.type == "cpu"
    if forward_tokens is None:
        forward_tokens = FORWARD_TOKENS_CPU if on_cpu else FORWARD_TOKENS_ACCELERATOR
    measure = functools.partial(
        measure_compute_rps,
        config,
        device,
        dtype,
        quant_type=quant_type,
        tensor_parallel_devices=tensor_parallel_devices,
    )
    inference_rps = measure(n_tokens=1, n_steps=INFERENCE_STEPS_CPU if on_cpu else INFERENCE_STEPS, inference=True)
    forward_rps = measure(
        n_tokens=forward_tokens, n_steps=FORWARD_STEPS_CPU if on_cpu else FORWARD_STEPS, inference=False
    )
    network_rps = measure_network_rps(config, public_swarm=public_swarm)
    info = {"inference_rps": inference_rps, "forward_rps": forward_rps, "network_rps": network_rps}
    logger.info(
        f"throughput.figures(inference_rps={inference_rps:.1f}, forward_rps={forward_rps:.1f} "
        f"[{forward_tokens} tokens], network_rps={network_rps:.1f})"
    )
    return info


def measure_network_rps(config: Any, *, public_swarm: bool, timeout_s: float = 60.0) -> float:
    """Tokens/s of 16-bit hidden vectors the link carries. Only the public swarm runs speedtest (if installed);
    private swarms never contact anything outside and assume 100 Mbit/s."""
    bits_per_request = config.hidden_size * 16
    speed = DEFAULT_NETWORK_SPEED_BITS_PER_S
    if public_swarm:
        measured = _speedtest_bits_per_s(timeout_s)
        if measured is not None and measured > 0:
            speed = measured
    return float(speed / bits_per_request)


def _speedtest_bits_per_s(timeout_s: float) -> float | None:
    try:
        import speedtest  # noqa: F401  (speedtest-cli, optional)
    except ImportError:
        logger.info("throughput.network(speedtest-cli not installed, assuming 100 Mbit/s)")
        return None
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        try:
            return pool.apply_async(_run_speedtest).get(timeout=timeout_s)
        except Exception as e:
            logger.warning(f"throughput.network_failed({e!r}), assuming 100 Mbit/s")
            return None


def _run_speedtest() -> float:
    import speedtest

    tester = speedtest.Speedtest()
    tester.get_servers()
    tester.get_best_server()
    return min(tester.download(), tester.upload())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_compute_rps(
    config: Any,
    device: torch.device,
    dtype: torch.dtype,
    *,
    quant_type: str = "none",
    tensor_parallel_devices: Sequence[torch.device] = (),
    n_tokens: int,
    n_steps: int,
    inference: bool,
) -> float:
    """Tokens per second per block of a random-init block with the same config, dtype and quantization."""
    family = get_family(config)
    built = family.build_block(config, 0).to(dtype)
    block = place_block(built, device=device, quant_type=quant_type, tensor_parallel_devices=tensor_parallel_devices)
    if not isinstance(block, CorollaBlock):  # place_block splits and quantizes the block in place
        raise TypeError(f"place_block returned a {type(block).__name__}, not the block it was given")
    block.eval()
    hidden_size = config.hidden_size
    with torch.inference_mode():
        cache = None
        if inference:
            descriptors = block.cache_descriptors(1, n_steps + 1)
            cache = [torch.zeros(tuple(d.shape), dtype=d.dtype, device=device) for d in descriptors]
        elapsed = 0.0
        for step in range(n_steps + 1):  # step 0 warms up
            inputs = torch.randn(1, n_tokens, hidden_size, device=device, dtype=dtype)  # [1, T, H]
            _synchronize(device)
            start = time.perf_counter()
            if inference:
                block(inputs, cache=cache, position=step)
            else:
                block(inputs)
            _synchronize(device)
            if step > 0:
                elapsed += time.perf_counter() - start
    del block, cache
    return float(n_steps * n_tokens / max(elapsed, 1e-9))

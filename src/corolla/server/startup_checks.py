"""Start-up checks of a server's device, dtype and quantization, run before it loads anything or joins the swarm: a
setting that cannot run on this machine raises `ConfigurationError` with one line saying what to change (the CLI
exits with code 2 and never retries it), and defaults follow what is installed (nf4 on CUDA only with bitsandbytes)."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence

import torch

from corolla.models.config import resolve_block_dtype
from corolla.models.prequantized import PrequantizedFormat
from corolla.utils.errors import ConfigurationError
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

QUANTIZED_TYPES = ("int8", "nf4")
BNB_INSTALL_HINT = "pip install bitsandbytes (or pip install 'corolla[gpu]')"


def default_device() -> torch.device:
    """cuda:0 when CUDA works, else mps when available, else cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda:0")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def check_device(requested: str | torch.device, *, flag: str = "--device") -> torch.device:
    """The torch device named by `requested` (cuda -> cuda:0) if it exists here; else `ConfigurationError`."""
    try:
        device = torch.device(requested)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigurationError(f"{flag} {requested}: not a torch device (use cpu, cuda, cuda:N or mps)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            if torch.version.cuda is None:
                why = f"this torch ({torch.__version__}) is a CPU-only build: install a CUDA build of torch"
            else:
                why = "no CUDA device is visible (no driver, or CUDA_VISIBLE_DEVICES hides them); use --device cpu"
            raise ConfigurationError(f"{flag} {requested}: CUDA is not available here: {why}")
        count = torch.cuda.device_count()
        index = 0 if device.index is None else device.index
        if index >= count:
            raise ConfigurationError(f"{flag} {requested}: this machine has {count} CUDA device(s) (0..{count - 1})")
        return torch.device("cuda", index)
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ConfigurationError(f"{flag} {requested}: MPS (Apple GPU) is not available here; use --device cpu")
        return device
    if device.type == "cpu":
        return device
    backend = getattr(torch, device.type, None)
    if backend is None or not hasattr(backend, "is_available") or not backend.is_available():
        raise ConfigurationError(f"{flag} {requested}: device type {device.type!r} is not available here")
    return device


def bitsandbytes_problem() -> str | None:
    """None when bitsandbytes imports here, else why not (one line)."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed"
    try:
        importlib.import_module("bitsandbytes")
    except Exception as e:  # a broken install (CUDA libraries missing, ...) must not end in a traceback later
        first_line = (str(e).strip().splitlines() or [""])[0]
        return f"bitsandbytes is installed but does not import ({type(e).__name__}: {first_line})"
    return None


def resolve_quant_type(requested: str | None, device: torch.device, *, log: bool = True) -> str:
    """An explicit int8/nf4 needs CUDA and a working bitsandbytes; unset -> nf4 on CUDA when bitsandbytes works
    (as Petals), else none, said in the log."""
    if requested is not None and requested not in QUANTIZED_TYPES:
        return requested
    if requested is not None:
        if device.type != "cuda":
            raise ConfigurationError(
                f"--quant_type {requested} needs a CUDA device (the device is {device}); use --quant_type none"
            )
        problem = bitsandbytes_problem()
        if problem is not None:
            raise ConfigurationError(f"--quant_type {requested} needs bitsandbytes: {problem}; {BNB_INSTALL_HINT}")
        return requested
    if device.type != "cuda":
        return "none"
    problem = bitsandbytes_problem()
    if problem is not None:
        if not log:
            return "none"
        logger.warning(
            f"server.quant_default(quant=none, reason={problem}): {BNB_INSTALL_HINT} to serve in nf4 (about 3.5x "
            "more blocks per GPU), or pass --quant_type none to silence this"
        )
        return "none"
    if log:
        logger.info("server.quant_default(quant=nf4, reason=CUDA with bitsandbytes)")
    return "nf4"


def checkpoint_quant_type(requested: str | None, resolved: str, model_config) -> str:
    """The quantization to serve a checkpoint in: `resolved` (resolve_quant_type's), but where the checkpoint is
    saved pre-quantized by bitsandbytes and no --quant_type was given, its own kind on a GPU that quantizes (an
    LLM.int8 save in int8, not re-quantized to nf4), said in the log. ConfigurationError for a quantization corolla
    does not read (GPTQ, AWQ, FP4), before any block is loaded."""
    stored = PrequantizedFormat.of_config(model_config)
    if stored is None or requested is not None or resolved == "none" or stored.quant_type == resolved:
        return resolved
    logger.info(f"server.quant_default(quant={stored.quant_type}, reason=the checkpoint is saved in it)")
    return stored.quant_type


def _bf16_supported(device: torch.device) -> bool:
    if device.type != "cuda":
        return True  # CPU runs bf16 (slowly without AVX512-BF16/AMX); MPS is switched to fp16 by resolve_block_dtype
    return bool(torch.cuda.is_bf16_supported(including_emulation=False))  # (the keyword: torch >= 2.4)


def resolve_dtype(model_config, requested: str, device: torch.device) -> torch.dtype:
    """The blocks' dtype: an explicit one must run on `device`; "auto" falls back from bfloat16 to float16 on GPUs
    without bf16 (pre-Ampere), said in the log."""

    try:
        dtype = resolve_block_dtype(model_config, requested, device=device)
    except ValueError as e:
        raise ConfigurationError(f"--torch_dtype {requested}: {e}") from None
    if dtype == torch.bfloat16 and not _bf16_supported(device):
        name = torch.cuda.get_device_name(device)
        if requested != "auto":
            raise ConfigurationError(
                f"--torch_dtype bfloat16: {device} ({name}) has no bfloat16 support; use --torch_dtype float16"
            )
        logger.info(f"server.dtype_default(dtype=float16, reason={name} has no bfloat16)")
        dtype = torch.float16
    return dtype


def resolve_device_and_quant(
    device: str | None,
    quant_type: str | None,
    tensor_parallel_devices: Sequence[str] | None = None,
    *,
    log: bool = True,
) -> tuple[torch.device, str]:
    """Checks the device (and tensor-parallel devices) and the quantization; needs no model, so it runs first."""
    resolved = check_device(device) if device is not None else default_device()
    for tp_device in tensor_parallel_devices or ():
        check_device(tp_device, flag="--tensor_parallel_devices")
    return resolved, resolve_quant_type(quant_type, resolved, log=log)


def check_settings(config) -> None:
    """The checks of a `ServerConfig` that need no model (device, tensor-parallel devices, quantization, an explicit
    dtype): the CLI runs them before its heavy imports, so a setting that cannot run here ends within seconds."""
    device, _ = resolve_device_and_quant(config.device, config.quant_type, config.tensor_parallel_devices, log=False)
    if config.torch_dtype != "auto":
        resolve_dtype(None, config.torch_dtype, device)  # an explicit dtype never reads the model config

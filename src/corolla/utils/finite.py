"""Whether a tensor (or the bytes of one) holds only finite values, exactly and cheaply: every hidden state that
crosses the network is checked once (the server's decoder, a KV import, the client's check of a server's output)."""

from __future__ import annotations

import sys

import numpy as np
import torch

# 16-bit floats: (mask of every bit but the sign, +inf's bit pattern: it and every magnitude above are inf or NaN)
_HALF_NONFINITE = {torch.bfloat16: (0x7FFF, 0x7F80), torch.float16: (0x7FFF, 0x7C00)}
# the high byte of every non-finite 16-bit float is one of these (its exponent's high bits all set: bfloat16's
# 0x7F/0xFF also hold finite values of magnitude >= 2**127, float16's only inf and NaN)
_HALF_HIGH_BYTES = {
    torch.bfloat16: (b"\x7f", b"\xff"),
    torch.float16: tuple(bytes([b]) for b in b"\x7c\x7d\x7e\x7f\xfc\xfd\xfe\xff"),
}
_HIGH_BYTE_AT = 1 if sys.byteorder == "little" else 0  # where a 16-bit value's high byte sits, native order


def all_finite(tensor: torch.Tensor) -> bool:
    """True if no value is NaN or infinite, exactly. Host tensors are checked through numpy: 16-bit floats on their
    bits with one reduction (the largest magnitude is below +inf's pattern; numpy has no bfloat16 and its float16
    ufuncs are slow), the others with `isfinite`; device tensors with torch."""
    if not tensor.is_cpu:
        return bool(torch.isfinite(tensor).all())
    if tensor.numel() == 0:
        return True
    data = tensor.detach() if tensor.requires_grad else tensor
    half = _HALF_NONFINITE.get(data.dtype)
    if half is None:  # ufunc reductions called directly: ndarray.all/max go through numpy's Python wrappers
        return bool(np.logical_and.reduce(np.isfinite(data.numpy()), axis=None))
    magnitude_mask, infinity = half
    bits = data.view(torch.int16).numpy().view(np.uint16)  # [same shape] the raw 16-bit patterns
    return int(np.maximum.reduce(bits & magnitude_mask, axis=None)) < infinity


_NUMPY_FLOATS = {torch.float32: np.float32, torch.float64: np.float64}


def bytes_finite(data: bytes | memoryview, dtype: torch.dtype) -> bool:
    """`all_finite` of a CPU float tensor of `dtype` holding `data` (its values, native byte order), read straight
    from the bytes (no tensor): 16-bit floats on their bits, the others with `isfinite`."""
    half = _HALF_NONFINITE.get(dtype)
    if half is not None:
        # usual hidden states: no value's high byte could be non-finite's, told by a strided copy of the high bytes
        # and a memchr per candidate byte, with the GIL held (numpy's ufuncs release it for arrays of this size, and
        # the serving loop then waits for it to come back from the device thread); else the exact check below
        if isinstance(data, bytes):  # (a memoryview's strided copy is slow: numpy then)
            high = data[_HIGH_BYTE_AT::2]
            for candidate in _HALF_HIGH_BYTES[dtype]:
                if candidate in high:
                    break
            else:
                return True
        bits = np.frombuffer(data, dtype=np.uint16)  # [numel] the raw 16-bit patterns
        if bits.size == 0:
            return True
        magnitude_mask, infinity = half
        return int(np.maximum.reduce(bits & magnitude_mask, axis=None)) < infinity
    values = np.frombuffer(data, dtype=_NUMPY_FLOATS[dtype])  # [numel]; KeyError: not a float dtype
    return bool(np.logical_and.reduce(np.isfinite(values), axis=None))

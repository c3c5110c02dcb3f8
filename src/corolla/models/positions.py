"""Position encodings computed on the fly (no buffers, so blocks can be built on `meta` and moved freely):
rotary embeddings of the `rope_parameters` types default/linear/dynamic/llama3/yarn (and longrope, for the families
that allow it), over all of a head's channels or its first ones (partial rotary), and ALiBi slopes."""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_parameters(config, *, also: tuple[str, ...] = ()) -> dict[str, Any]:
    """The config's rotary parameters as one dict (transformers 5 `rope_parameters`, or legacy
    `rope_theta` + `rope_scaling`); `also`: rope types a family accepts beyond `SUPPORTED_ROPE_TYPES` (Phi-3's
    "longrope", which the fused kernels do not implement)."""
    params = getattr(config, "rope_parameters", None)
    if params:
        params = dict(params)
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    params["rope_type"] = rope_type
    if rope_type == "longrope":
        params.setdefault("original_max_position_embeddings", getattr(config, "original_max_position_embeddings", None))
    if rope_type not in SUPPORTED_ROPE_TYPES + also:
        raise ValueError(f"Unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES + also}")
    return params


class RotaryEmbedding:
    """Rotates the first `head_dim` channels of q's and k's heads (all of them but under partial rotary) by absolute
    positions; `inv_freq` is recomputed per device (cheap: head_dim/2 values).

    Frequencies that depend on the sequence's length (dynamic NTK past `max_position_embeddings`; LongRoPE's long
    factors past `original_max_position_embeddings`) follow the end of the current call (`position + length`), as in
    transformers: tokens written while the sequence was short keep their rotation."""

    def __init__(self, head_dim: int, params: dict[str, Any], max_position_embeddings: int):
        self.head_dim = head_dim
        self.params = params
        self.rope_type: str = params["rope_type"]
        self.max_position_embeddings = max_position_embeddings
        self._cache: dict[tuple[torch.device, int], torch.Tensor] = {}
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self.attention_scaling = 1.0  # multiplies cos and sin (YaRN's and LongRoPE's attention factors)
        # the length past which the frequencies change (None: never)
        self.switch_length: int | None = None
        if self.rope_type == "yarn":
            self.attention_scaling = yarn_attention_factor(params, max_position_embeddings)
        elif self.rope_type == "dynamic":
            self.switch_length = max_position_embeddings
        elif self.rope_type == "longrope":
            self.switch_length = int(params["original_max_position_embeddings"])
            self.attention_scaling = longrope_attention_factor(params, max_position_embeddings)
            for name in ("short_factor", "long_factor"):
                if len(params[name]) != head_dim // 2:
                    raise ValueError(f"longrope {name} needs {head_dim // 2} values (rotary dims / 2), got "
                                     f"{len(params[name])}")  # fmt: skip

    def _base_inv_freq(self, device: torch.device, base: float) -> torch.Tensor:
        dim = self.head_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim  # [hd/2]
        return 1.0 / (base**exponents)

    def inv_freq(self, device: torch.device, seq_len: int) -> torch.Tensor:
        """[head_dim/2] fp32; depends on `seq_len` only for dynamic NTK scaling beyond the trained length."""
        key_len = 0
        base = float(self.params["rope_theta"])
        if self.rope_type == "dynamic" and seq_len > self.max_position_embeddings:
            factor = float(self.params["factor"])
            dim = self.head_dim
            base = base * ((factor * seq_len / self.max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
            key_len = seq_len
        elif self.switch_length is not None and self.rope_type == "longrope" and seq_len > self.switch_length:
            key_len = -1  # the long factors, cached apart from the short ones
        key = (device, key_len)
        if key in self._cache:
            return self._cache[key]
        with torch.inference_mode(False), torch.no_grad():  # cached: must stay usable by later autograd passes
            return self._inv_freq_uncached(device, base, key)

    def _inv_freq_uncached(self, device: torch.device, base: float, key: tuple[torch.device, int]) -> torch.Tensor:
        key_len = key[1]
        inv_freq = self._base_inv_freq(device, base)
        if self.rope_type == "linear":
            inv_freq = inv_freq / float(self.params["factor"])
        elif self.rope_type == "llama3":
            inv_freq = _llama3_scale(inv_freq, self.params)
        elif self.rope_type == "yarn":
            inv_freq = yarn_inv_freq(self.head_dim, self.params, self.max_position_embeddings, device)
        elif self.rope_type == "longrope":
            factors = self.params["long_factor" if key_len < 0 else "short_factor"]
            inv_freq = inv_freq / torch.tensor([float(f) for f in factors], dtype=torch.float32, device=device)
        if key_len <= 0:
            self._cache[key] = inv_freq
        return inv_freq

    def _compute(self, start: int, end: int, device: torch.device, dtype: torch.dtype, seq_len: int):
        cos, sin = rotary_cos_sin(self.inv_freq(device, seq_len), start, end, device, self.attention_scaling)
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((sin, sin), dim=-1).to(dtype)  # [T, hd] each

    def cos_sin(self, position: int, length: int, device: torch.device, dtype: torch.dtype):
        """cos, sin: [length, head_dim] for absolute positions position..position+length-1, in `dtype`.
        Served from a per-device table (grown by doubling) unless the length changes the frequencies."""
        end = position + length
        if (self.switch_length is not None and end > self.switch_length) or device.type == "meta":
            return self._compute(position, end, device, dtype, end)
        key = (device, dtype)
        table = self._tables.get(key)
        if table is None or table[0].shape[0] < end:
            size = max(256, 1 << (end - 1).bit_length())
            if self.switch_length is not None:
                size = min(size, self.switch_length)
            with torch.inference_mode(False), torch.no_grad():  # cached: must not be an inference tensor
                table = self._compute(0, size, device, dtype, size)
            self._tables[key] = table
        return table[0][position:end], table[1][position:end]

    def apply(self, q: torch.Tensor, k: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B,h,T,hd], k [B,kv,T,hd] -> rotated copies (same shapes and dtype): channels [:head_dim] of each head,
        the rest unchanged."""
        r = self.head_dim
        cos, sin = self.cos_sin(position, q.shape[-2], q.device, q.dtype)  # [T, r]
        if q.shape[-1] == r:
            return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        q_rot, k_rot = self.apply(q[..., :r], k[..., :r], position)  # [B, h, T, r], [B, kv, T, r]
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)


def rotary_cos_sin(
    inv_freq: torch.Tensor, start: int, end: int, device: torch.device, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [end - start, D/2] float32 of positions [start, end) for the frequencies `inv_freq` [D/2], times
    `scale` (YaRN's and LongRoPE's attention factor multiplies cos and sin): the one formula of the blocks' rotary
    (`RotaryEmbedding`, each half of a head's channels) and of the fused spans' tables."""
    positions = torch.arange(start, end, dtype=torch.float32, device=device)  # [T]
    freqs = positions[:, None] * inv_freq.to(device, torch.float32)[None, :]  # [T, D/2]
    return freqs.cos() * scale, freqs.sin() * scale


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _llama3_scale(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths divided by `factor`, short ones kept, smooth between."""
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def longrope_attention_factor(params: dict[str, Any], max_position_embeddings: int) -> float:
    """LongRoPE's cos/sin multiplier: `attention_factor` when given, else sqrt(1 + ln(factor) / ln(original))."""
    given = params.get("attention_factor")
    if given is not None:
        return float(given)
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor") or max_position_embeddings / original
    return math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(params: dict[str, Any], max_position_embeddings: int) -> float:
    """The multiplier applied to cos and sin: `attention_factor` when given, else from `factor` (and the
    `mscale` / `mscale_all_dim` ratio when both are set)."""
    given = params.get("attention_factor")
    if given is not None:
        return float(given)
    factor = _factor(params, max_position_embeddings)
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _mscale(factor, float(mscale)) / _mscale(factor, float(mscale_all_dim))
    return _mscale(factor)


def _factor(params: dict[str, Any], max_position_embeddings: int) -> float:
    factor = params.get("factor")
    if factor is None:
        return max_position_embeddings / float(params["original_max_position_embeddings"])
    return float(factor)


def _correction_dim(rotations: float, dim: int, base: float, original_length: float) -> float:
    """The rotary dimension index whose wavelength completes `rotations` turns over `original_length` tokens."""
    return dim * math.log(original_length / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(dim: int, params: dict[str, Any], max_position_embeddings: int, device: torch.device) -> torch.Tensor:
    """[dim/2] fp32 inverse frequencies: dimensions below the ramp keep their frequency (extrapolation), those
    above are divided by `factor` (interpolation), a linear ramp in between."""
    base = float(params["rope_theta"])
    factor = _factor(params, max_position_embeddings)
    original_length = float(params["original_max_position_embeddings"])
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)
    low = _correction_dim(beta_fast, dim, base, original_length)
    high = _correction_dim(beta_slow, dim, base, original_length)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp needs a non-empty interval
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim  # [dim/2]
    pos_freqs = base**exponents
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # [dim/2]: 1 keeps the original frequency
    return interpolated * (1 - keep) + extrapolated * keep


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """[num_heads] fp32 ALiBi slopes (geometric series; interleaved extras when heads is not a power of 2)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = torch.pow(torch.tensor(base, dtype=torch.float32), torch.arange(1, 1 + closest, dtype=torch.int32))
    if closest != num_heads:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        remaining = min(closest, num_heads - closest)
        extra = torch.pow(
            torch.tensor(extra_base, dtype=torch.float32), torch.arange(1, 1 + 2 * remaining, 2, dtype=torch.int32)
        )
        slopes = torch.cat([slopes, extra])
    return slopes

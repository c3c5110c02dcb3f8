"""Position encodings computed on the fly (no buffers, so blocks can be built on `meta` and moved freely):
rotary embeddings with the `rope_parameters` types default/linear/dynamic/llama3, and ALiBi slopes."""

from __future__ import annotations

import math
from typing import Any

import torch

from corolla.models.rope_yarn import yarn_attention_factor, yarn_inv_freq

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_parameters(config) -> dict[str, Any]:
    """The config's rotary parameters as one dict (transformers 5 `rope_parameters`, or legacy
    `rope_theta` + `rope_scaling`)."""
    params = getattr(config, "rope_parameters", None)
    if params:
        params = dict(params)
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    params["rope_type"] = rope_type
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"Unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    return params


class RotaryEmbedding:
    """Rotates q and k by absolute positions; `inv_freq` is recomputed per device (cheap: head_dim/2 values)."""

    def __init__(self, head_dim: int, params: dict[str, Any], max_position_embeddings: int):
        self.head_dim = head_dim
        self.params = params
        self.rope_type: str = params["rope_type"]
        self.max_position_embeddings = max_position_embeddings
        self._cache: dict[tuple[torch.device, int], torch.Tensor] = {}
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self.attention_scaling = 1.0  # multiplies cos and sin (YaRN's attention factor)
        if self.rope_type == "yarn":
            self.attention_scaling = yarn_attention_factor(params, max_position_embeddings)

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
        if key_len == 0:
            self._cache[key] = inv_freq
        return inv_freq

    def _compute(self, start: int, end: int, device: torch.device, dtype: torch.dtype, seq_len: int):
        inv_freq = self.inv_freq(device, seq_len)
        positions = torch.arange(start, end, device=device, dtype=torch.float32)  # [T]
        freqs = positions[:, None] * inv_freq[None, :]  # [T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, hd]
        scale = self.attention_scaling
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

    def cos_sin(self, position: int, length: int, device: torch.device, dtype: torch.dtype):
        """cos, sin: [length, head_dim] for absolute positions position..position+length-1, in `dtype`.
        Served from a per-device table (grown by doubling) unless dynamic scaling makes them length-dependent."""
        end = position + length
        if self.rope_type == "dynamic" and end > self.max_position_embeddings:
            return self._compute(position, end, device, dtype, end)
        if device.type == "meta":
            return self._compute(position, end, device, dtype, end)
        key = (device, dtype)
        table = self._tables.get(key)
        if table is None or table[0].shape[0] < end:
            size = max(256, 1 << (end - 1).bit_length())
            if self.rope_type == "dynamic":
                size = min(size, self.max_position_embeddings)
            with torch.inference_mode(False), torch.no_grad():  # cached: must not be an inference tensor
                table = self._compute(0, size, device, dtype, size)
            self._tables[key] = table
        return table[0][position:end], table[1][position:end]

    def apply(self, q: torch.Tensor, k: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B,h,T,hd], k [B,kv,T,hd] -> rotated copies (same shapes and dtype)."""
        cos, sin = self.cos_sin(position, q.shape[-2], q.device, q.dtype)  # [T, hd]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


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

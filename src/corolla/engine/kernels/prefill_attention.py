"""Causal attention of a prefill chunk over its sequence's whole history: the chunk's T queries are the last T of
the L positions whose keys and values it attends to.

An explicit [T, L] mask sends torch to a slower masked kernel; flash attention's own causal mask is aligned to the
lower right corner (the last query sees every key), exactly this case, and takes grouped K/V heads as they are.
torch's public way to ask for it, `causal_lower_right`, costs more host time per call than the kernel, and the
cached turn is host-bound; so where flash attention takes the
inputs (CUDA, half precision, equal key and value head sizes; checked once per shape) its op is called directly,
elsewhere on CUDA (MLA's value heads) the lower-right bias lets torch pick the memory-efficient kernel's own mask
(docs/decisions/0019), and on the CPU the [T, L] mask that bias would materialize is built here (0223)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_flash_attention

# (device, dtype, query heads, key heads, key head size, value head size) -> whether flash attention takes them
_FLASH_FITS: dict[tuple[torch.device, torch.dtype, int, int, int, int], bool] = {}


def causal_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, enable_gqa: bool = False
) -> torch.Tensor:
    """q [1, nq, T, Dk] at the last T of the L positions of k [1, nkv, L, Dk] and v [1, nkv, L, Dv] (T <= L); each
    query attends to every position up to its own. Returns [1, nq, T, Dv]."""
    t, total = q.shape[2], k.shape[2]
    if t > total:
        raise ValueError(f"a chunk of {t} queries attends to at least its own {t} positions, got {total}")
    if t == total:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    if flash_fits(q, k, v, enable_gqa):
        # flash attention's is_causal is the lower-right alignment when T < L (what torch's CausalBias calls too)
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[0]
    if q.device.type != "cuda":
        # the mask torch's lower-right bias materializes here (no memory-efficient kernel off CUDA), built directly:
        # the bias's module imports torch._dynamo (1.3-2.5 s of CPU), which a CPU server paid in its first chunk
        # after a prefix, a new turn's first token (docs/decisions/0223)
        mask = torch.ones((t, total), dtype=torch.bool, device=q.device).tril(total - t)  # [T, L], key j <= L-T+i
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    # imported here, not at the top: torch.nn.attention.bias imports torch._dynamo (~2.5 s of CPU), which every
    # server and CLI process would pay at start-up for a path that most of them never take
    from torch.nn.attention.bias import causal_lower_right

    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_lower_right(t, total), scale=scale, enable_gqa=enable_gqa
    )


def flash_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> bool:
    """Whether torch's flash attention kernel takes these inputs as they are (CUDA only; decided once per shape)."""
    if q.device.type != "cuda" or q.shape[-1] != v.shape[-1] or q.shape[-1] % 8:
        return False
    # asked without is_causal: torch's check refuses it for T < L, which its upper-left semantics would break
    key = (q.device, q.dtype, q.shape[1], k.shape[1], k.shape[-1], v.shape[-1])
    fits = _FLASH_FITS.get(key)
    if fits is None:
        fits = _FLASH_FITS[key] = bool(can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, enable_gqa)))
    return fits


def paged_prefill_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor, *, scale: float
) -> torch.Tensor:
    """q [R, nq, D]: its first t rows are the queries at positions [start, start + t) of the sequence whose pages
    `index` [2 + maxp] int32 (start, t, then the block table) names, in k_cache/v_cache [pages, page, nkv, D]; each
    attends causally to the sequence's positions up to its own. Returns [R, nq, D], the rows past t zero. Reads
    start and t on the host: the CPU's path and the reference of `prefill_attention_triton.paged_prefill_attention`,
    which reads them on the device."""
    start, t = (int(x) for x in index[:2].tolist())
    r, nq, d = q.shape
    page, nkv = k_cache.shape[1], k_cache.shape[2]
    positions = torch.arange(start + t, device=q.device)  # [L]
    key_slots = index[2:].index_select(0, positions // page).long() * page + positions % page  # [L]
    k = k_cache.reshape(-1, nkv, d).index_select(0, key_slots).transpose(0, 1)[None]  # [1, nkv, L, D]
    v = v_cache.reshape(-1, nkv, v_cache.shape[-1]).index_select(0, key_slots).transpose(0, 1)[None]
    out = q.new_zeros((r, nq, v.shape[-1]))
    attn = causal_prefill_attention(q[:t].transpose(0, 1)[None], k, v, scale=scale, enable_gqa=nkv != nq)
    out[:t] = attn[0].transpose(0, 1)  # [t, nq, Dv]
    return out

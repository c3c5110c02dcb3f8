"""SpanBackend (forward, each block's forward and backward, long forwards through a cache, what it refuses) and the
reference built on it (`tests/helpers/reference_backend`: backward, inference steps with chunking, hypo_ids, rollback)
checked against its plain forward. The session limits live in the engine and the front and are tested there
(test_engine_decode, test_server_malformed): docs/decisions/0064."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from tests.helpers import reference_backend as oracle
from torch import nn

from corolla.engine import EngineConfig, SpanEngine
from corolla.engine.kv.page_queue import PageQueue
from corolla.models.block_base import TensorDescriptor
from corolla.server.backend import SpanBackend
from corolla.server.core.runtime import PRIORITY_INFERENCE, Runtime

HIDDEN, HEADS, KV_HEADS, NUM_BLOCKS = 32, 4, 2, 4
ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("single_torch_thread")


class FakeBlock(nn.Module):
    """A small rotary GQA decoder layer that follows the CorollaBlock contract (cache K/V [B, kv, L, hd])."""

    def __init__(self, hidden: int, heads: int, kv_heads: int):
        super().__init__()
        self.hidden_size = hidden
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q = nn.Linear(hidden, heads * self.head_dim)
        self.kv = nn.Linear(hidden, 2 * kv_heads * self.head_dim)
        self.o = nn.Linear(heads * self.head_dim, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))

    def cache_descriptors(self, batch_size: int, max_length: int) -> list[TensorDescriptor]:
        p = self.o.weight
        shape = (batch_size, self.kv_heads, max_length, self.head_dim)
        return [TensorDescriptor(shape, p.dtype, p.device), TensorDescriptor(shape, p.dtype, p.device)]

    def _rotate(self, x: torch.Tensor, position: int) -> torch.Tensor:
        T, half = x.shape[2], self.head_dim // 2
        freqs = 1.0 / (100.0 ** (torch.arange(half, dtype=torch.float32) / half))  # [hd/2]
        angles = torch.arange(position, position + T, dtype=torch.float32)[:, None] * freqs  # [T, hd/2]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def forward(self, x: torch.Tensor, *, cache: list[torch.Tensor] | None = None, position: int = 0) -> torch.Tensor:
        B, T, _ = x.shape
        h = self.norm1(x)
        q = self._rotate(self.q(h).view(B, T, self.heads, self.head_dim).transpose(1, 2), position)  # [B,h,T,hd]
        k, v = self.kv(h).view(B, T, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # [B,kv,T,hd] each
        k = self._rotate(k, position)
        if cache is not None:
            k_cache, v_cache = cache
            k_cache[:, :, position : position + T] = k
            v_cache[:, :, position : position + T] = v
            k, v = k_cache[:, :, : position + T], v_cache[:, :, : position + T]
        S = k.shape[2]
        allowed = torch.ones(T, S, dtype=torch.bool).tril(diagonal=S - T)  # query i sees keys <= its position
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)  # [B,h,T,hd]
        x = x + self.o(attn.transpose(1, 2).reshape(B, T, -1))
        return x + self.mlp(self.norm2(x))


def _build_family_blocks(family: str):
    """Real corolla blocks through the models registry (tiny random configs, no weights loaded)."""
    from transformers import BloomConfig, LlamaConfig

    from corolla.models.registry import get_family

    if family == "llama":
        config = LlamaConfig(
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            num_hidden_layers=NUM_BLOCKS,
            max_position_embeddings=256,
        )
    else:
        config = BloomConfig(hidden_size=HIDDEN, n_head=HEADS, n_layer=NUM_BLOCKS)
    return config, {i: get_family(config).build_block(config, i) for i in range(NUM_BLOCKS)}


def _build_fake_blocks():
    config = SimpleNamespace(hidden_size=HIDDEN, num_attention_heads=HEADS)
    return config, {i: FakeBlock(HIDDEN, HEADS, KV_HEADS) for i in range(NUM_BLOCKS)}


@pytest.fixture(params=["fake", "llama", "bloom"])
def blocks_and_config(request):
    torch.manual_seed(0)
    if request.param == "fake":
        config, blocks = _build_fake_blocks()
    else:
        try:
            config, blocks = _build_family_blocks(request.param)
        except ImportError as e:
            pytest.skip(f"corolla {request.param} block not available yet: {e}")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for block in blocks.values():
            for p in block.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    return blocks, config


def make_backend(blocks_and_config, **kwargs) -> SpanBackend:
    blocks, config = blocks_and_config
    kwargs.setdefault("max_chunk_size_bytes", 2**30)
    return SpanBackend(blocks, config=config, dtype=torch.float32, device="cpu", **kwargs)


def new_cache(backend: SpanBackend, indices: list[int], batch_size: int, max_length: int) -> list[list[torch.Tensor]]:
    return [
        [torch.zeros(d.shape, dtype=d.dtype) for d in descriptors]
        for descriptors in backend.cache_descriptors(indices, batch_size, max_length)
    ]


def plain_stack(backend: SpanBackend, indices: list[int], x: torch.Tensor) -> torch.Tensor:
    for i in indices:
        x = backend.blocks[i](x)
    return x


def test_forward_equals_the_plain_stack_of_blocks(blocks_and_config) -> None:
    backend = make_backend(blocks_and_config)
    x = torch.randn(2, 7, HIDDEN)
    with torch.no_grad():
        expected = plain_stack(backend, [1, 2, 3], x)
    assert torch.allclose(backend.forward([1, 2, 3], x), expected, atol=ATOL)
    assert backend.forward([0], x[:, :0]).shape == (2, 0, HIDDEN)


@pytest.mark.parametrize("chunk_bytes", [1, 3 * 4 * HEADS * 2 * 12])
def test_inference_prefill_then_decode_equals_forward_chunked_or_not(blocks_and_config, chunk_bytes) -> None:
    reference = make_backend(blocks_and_config)
    chunked = make_backend(blocks_and_config, max_chunk_size_bytes=chunk_bytes)
    indices = [0, 1, 2, 3]
    x = torch.randn(2, 12, HIDDEN)
    expected = reference.forward(indices, x)  # [2, 12, H]
    for backend in (reference, chunked):
        cache = new_cache(backend, indices, batch_size=2, max_length=16)
        out_prefill = oracle.inference_step(backend, indices, x[:, :9], cache, prefix_length=0, max_length=16)
        steps = [out_prefill]
        for t in range(9, 12):
            steps.append(
                oracle.inference_step(backend, indices, x[:, t : t + 1], cache, prefix_length=t, max_length=16)
            )
        assert torch.allclose(torch.cat(steps, dim=1), expected, atol=1e-4)
    # chunked prefill writes the same cache as unchunked
    cache_a = new_cache(reference, indices, 2, 16)
    cache_b = new_cache(chunked, indices, 2, 16)
    out_a = oracle.inference_step(reference, indices, x, cache_a, prefix_length=0, max_length=16)
    out_b = oracle.inference_step(chunked, indices, x, cache_b, prefix_length=0, max_length=16)
    assert torch.allclose(out_a, out_b, atol=1e-4)
    for tensors_a, tensors_b in zip(cache_a, cache_b, strict=True):
        for a, b in zip(tensors_a, tensors_b, strict=True):
            assert torch.allclose(a, b, atol=1e-4)


def test_chunk_length_keeps_attention_scores_under_the_limit(blocks_and_config) -> None:
    backend = make_backend(blocks_and_config, max_chunk_size_bytes=HEADS * 2 * 4 * 20 * 5)
    assert backend._max_chunk_length(batch_size=2, total_length=20) == 5
    assert backend._max_chunk_length(batch_size=2, total_length=10_000) == 1


def test_hypo_ids_reorder_the_cache(blocks_and_config) -> None:
    backend = make_backend(blocks_and_config)
    indices = [1, 2]
    x, new_token = torch.randn(3, 6, HIDDEN), torch.randn(3, 1, HIDDEN)
    hypo_ids = torch.tensor([2, 0, 0])
    cache = new_cache(backend, indices, 3, 8)
    oracle.inference_step(backend, indices, x, cache, prefix_length=0, max_length=8)
    out = oracle.inference_step(backend, indices, new_token, cache, prefix_length=6, max_length=8, hypo_ids=hypo_ids)

    fresh = new_cache(backend, indices, 3, 8)
    oracle.inference_step(backend, indices, x[hypo_ids], fresh, prefix_length=0, max_length=8)
    expected = oracle.inference_step(backend, indices, new_token, fresh, prefix_length=6, max_length=8)
    assert torch.allclose(out, expected, atol=1e-5)
    for tensors_a, tensors_b in zip(cache, fresh, strict=True):
        for a, b in zip(tensors_a, tensors_b, strict=True):
            assert torch.allclose(a, b, atol=1e-5)


def test_rollback_overwrites_the_cache(blocks_and_config) -> None:
    backend = make_backend(blocks_and_config)
    indices = [0, 1, 2]
    a, b = torch.randn(1, 8, HIDDEN), torch.randn(1, 3, HIDDEN)
    cache = new_cache(backend, indices, 1, 10)
    oracle.inference_step(backend, indices, a, cache, prefix_length=0, max_length=10)
    out = oracle.inference_step(backend, indices, b, cache, prefix_length=5, max_length=10)  # back to position 5
    expected = backend.forward(indices, torch.cat([a[:, :5], b], dim=1))[:, 5:]
    assert torch.allclose(out, expected, atol=1e-4)
    # and decoding continues from the rolled-back state
    c = torch.randn(1, 1, HIDDEN)
    out_c = oracle.inference_step(backend, indices, c, cache, prefix_length=8, max_length=10)
    expected_c = backend.forward(indices, torch.cat([a[:, :5], b, c], dim=1))[:, 8:]
    assert torch.allclose(out_c, expected_c, atol=1e-4)


def test_backward_matches_autograd_on_a_plain_stack(blocks_and_config) -> None:
    backend = make_backend(blocks_and_config)
    indices = [1, 2, 3]
    x, grad_out = torch.randn(2, 5, HIDDEN), torch.randn(2, 5, HIDDEN)
    prompts = torch.randn(3, 1, 2, HIDDEN)

    x_ref, prompts_ref = x.clone().requires_grad_(True), prompts.clone().requires_grad_(True)
    hidden = x_ref
    for i, index in enumerate(indices):
        hidden = torch.cat([hidden[:, :2] + prompts_ref[i], hidden[:, 2:]], dim=1)
        hidden = backend.blocks[index](hidden)
    torch.autograd.backward(hidden, grad_out)

    grad_x, grad_prompts = oracle.backward(backend, indices, x, grad_out, prompts)
    assert torch.allclose(grad_x, x_ref.grad, atol=1e-4)
    assert grad_prompts is not None and grad_prompts.shape == prompts.shape
    assert torch.allclose(grad_prompts, prompts_ref.grad, atol=1e-4)
    # forward applies the same deep prompts
    assert torch.allclose(backend.forward(indices, x, prompts), hidden.detach(), atol=1e-4)

    grad_empty, grad_prompts_empty = oracle.backward(backend, indices, x[:, :0], grad_out[:, :0], prompts)
    assert grad_empty.shape == (2, 0, HIDDEN) and grad_prompts_empty is not None
    assert grad_prompts_empty.shape == prompts.shape and not grad_prompts_empty.any()

    grad_plain, none = oracle.backward(backend, indices, x, grad_out)
    assert none is None and grad_plain.shape == x.shape
    assert all(p.grad is None and not p.requires_grad for b in backend.blocks.values() for p in b.parameters())


def test_deep_prompts_in_inference_apply_at_absolute_positions(blocks_and_config) -> None:
    backend = make_backend(blocks_and_config)
    indices = [0, 1]
    x, prompts = torch.randn(2, 6, HIDDEN), torch.randn(2, 2, 3, HIDDEN)
    expected = backend.forward(indices, x, prompts)
    cache = new_cache(backend, indices, 2, 6)
    first = oracle.inference_step(backend, indices, x[:, :2], cache, prefix_length=0, max_length=6, prompts=prompts)
    second = oracle.inference_step(backend, indices, x[:, 2:], cache, prefix_length=2, max_length=6, prompts=prompts)
    assert torch.allclose(torch.cat([first, second], dim=1), expected, atol=1e-4)


def test_bad_requests_are_value_errors(blocks_and_config) -> None:
    backend = make_backend(blocks_and_config, adapters=("known",))
    x = torch.randn(1, 2, HIDDEN)
    cases = {
        "not served": lambda: backend.forward([3, 4], x),
        "contiguous": lambda: backend.forward([0, 2], x),
        "contiguous and ascending": lambda: backend.forward([1, 0], x),
        "at least one block": lambda: backend.forward([], x),
        "shape": lambda: backend.forward([0], torch.randn(1, 2, HIDDEN + 1)),
        "floating": lambda: backend.forward([0], torch.ones(1, 2, HIDDEN, dtype=torch.int64)),
        "prompts": lambda: backend.forward([0, 1], x, torch.randn(3, 1, 1, HIDDEN)),
        "Unknown adapter": lambda: backend.forward([0], x, None, "missing"),
        "grad_outputs": lambda: backend.check_backward([0], x, torch.randn(1, 3, HIDDEN), None),
    }
    for message, call in cases.items():
        with pytest.raises(ValueError, match=message):
            call()


def test_cache_descriptors_and_bytes_per_token(blocks_and_config) -> None:
    backend = make_backend(blocks_and_config)
    descriptors = backend.cache_descriptors([1, 2], batch_size=3, max_length=10)
    assert len(descriptors) == 2
    head_dim = HIDDEN // HEADS
    kv_heads = HEADS if getattr(blocks_and_config[1], "model_type", None) == "bloom" else KV_HEADS
    per_block_per_token = 2 * kv_heads * head_dim * 4  # K + V, fp32
    assert sum(d.nbytes for ds in descriptors for d in ds) == 2 * 3 * 10 * per_block_per_token
    assert backend.cache_bytes_per_token([1]) == per_block_per_token
    assert backend.cache_bytes_per_token() == NUM_BLOCKS * per_block_per_token
    with pytest.raises(ValueError):
        backend.cache_descriptors([0], batch_size=0, max_length=4)


async def test_runtime_pool_and_backend_together(blocks_and_config) -> None:
    """The serving path: pages taken in the loop, the blocks run eagerly over them in the device thread, pages
    returned on exit; the steps equal one forward."""
    backend = make_backend(blocks_and_config)
    indices = [0, 1, 2, 3]
    config = EngineConfig(kv_pool_bytes=1 << 20, page_size_tokens=16, max_seq_len_tokens=8)
    engine = SpanEngine.from_blocks([backend.blocks[i] for i in indices], config, fused=False)
    queue = PageQueue(engine.pool)
    free = engine.pool.pages_free
    x = torch.randn(1, 5, HIDDEN)
    expected = backend.forward(indices, x)
    with Runtime(max_batch_size_tokens=64) as runtime:
        slots = await queue.allocate(1, 8, timeout_s=0)
        session = engine.session_of(slots, 8, layers=(0, len(indices)))
        try:

            def step(hidden: torch.Tensor, prefix: int) -> torch.Tensor:
                return engine.step(session, hidden, prefix)

            outputs = [await runtime.submit(lambda: step(x[:, :3], 0), priority=PRIORITY_INFERENCE, size_tokens=3)]
            for t in (3, 4):
                outputs.append(
                    await asyncio.wait_for(
                        runtime.submit(
                            lambda t=t: step(x[:, t : t + 1], t), priority=PRIORITY_INFERENCE, size_tokens=1
                        ),
                        10,
                    )
                )
            assert engine.pool.pages_free == free - 1
        finally:
            queue.release(slots)
    assert torch.allclose(torch.cat(outputs, dim=1), expected, atol=1e-4)
    assert engine.pool.pages_free == free


def test_adapters_are_selected_per_request() -> None:
    from corolla.models.block_base import using_adapter
    from corolla.models.lora import LoraWeights, add_adapter

    torch.manual_seed(0)
    config, blocks = _build_family_blocks("llama")
    rank = 2
    for index, block in blocks.items():
        modules = {
            "self_attn.q_proj": (torch.randn(rank, HIDDEN), torch.randn(HIDDEN, rank), 0.5),
            "mlp.down_proj": (torch.randn(rank, 2 * HIDDEN), torch.randn(HIDDEN, rank), 0.5),
        }
        add_adapter(block, "tuned", LoraWeights("test", index, modules))
    backend = SpanBackend(blocks, config=config, dtype=torch.float32, device="cpu", adapters=("tuned",))
    indices, x = [0, 1, 2], torch.randn(1, 5, HIDDEN)
    with torch.no_grad(), using_adapter("tuned"):
        expected = plain_stack(backend, indices, x)
    base = backend.forward(indices, x)
    tuned = backend.forward(indices, x, None, "tuned")
    assert not torch.allclose(base, tuned, atol=1e-3)
    assert torch.allclose(tuned, expected, atol=1e-4)

    cache = new_cache(backend, indices, 1, 5)
    steps = oracle.inference_step(backend, indices, x, cache, prefix_length=0, max_length=5, adapter="tuned")
    assert torch.allclose(steps, expected, atol=1e-4)

    grad_out = torch.randn_like(x)
    x_ref = x.clone().requires_grad_(True)
    with using_adapter("tuned"):
        torch.autograd.backward(plain_stack(backend, indices, x_ref), grad_out)
    grad_x, _ = oracle.backward(backend, indices, x, grad_out, None, "tuned")
    assert torch.allclose(grad_x, x_ref.grad, atol=1e-4)
    with pytest.raises(ValueError, match="Unknown adapter"):
        backend.forward(indices, x, None, "other")


def test_tensor_parallel_blocks_give_the_same_steps() -> None:
    import copy

    from corolla.models.tensor_parallel import make_tensor_parallel

    torch.manual_seed(0)
    config, blocks = _build_family_blocks("llama")
    plain = SpanBackend(blocks, config=config, dtype=torch.float32, device="cpu")
    split_blocks = {i: make_tensor_parallel(copy.deepcopy(b), ["cpu", "cpu"]) for i, b in blocks.items()}
    split = SpanBackend(split_blocks, config=config, dtype=torch.float32, device="cpu", max_chunk_size_bytes=1)
    indices, x, token = [0, 1, 2, 3], torch.randn(2, 6, HIDDEN), torch.randn(2, 1, HIDDEN)
    hypo_ids = torch.tensor([1, 1])
    outputs = []
    for backend in (plain, split):
        cache = new_cache(backend, indices, 2, 8)
        first = oracle.inference_step(backend, indices, x, cache, prefix_length=0, max_length=8)
        second = oracle.inference_step(backend, indices, token, cache, prefix_length=6, max_length=8, hypo_ids=hypo_ids)
        outputs.append(torch.cat([first, second], dim=1))
    assert len(split.cache_descriptors(indices, 2, 8)[0]) == 4  # K and V per shard
    assert torch.allclose(outputs[0], outputs[1], atol=1e-4)

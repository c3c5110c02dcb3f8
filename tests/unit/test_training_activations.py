"""The store of forward activations kept for backwards (`server.core.training_activations`): exact matches per client,
one take per put, and its bounds: total bytes (the heaviest client's oldest entry goes first), age, and a device's free
memory floor."""

from __future__ import annotations

import torch

from corolla.server.core.training_activations import KeptActivations

SPAN = (0, 1, 2)
MIB = 2**20


def _entry(seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A received [1, 256, 1024] fp32 input (1 MiB) and its two later blocks' inputs (2 MiB)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, 256, 1024, generator=generator)
    return hidden, [hidden + 1, hidden + 2]


def test_a_hit_needs_the_same_client_span_adapter_inputs_and_prompts_and_takes_the_entry() -> None:
    store = KeptActivations(64 * MIB)
    hidden, inputs = _entry(0)
    prompts = torch.ones(3, 1, 2, 1024)
    assert store.put("a", SPAN, "", hidden, prompts, inputs)
    assert store.take("b", SPAN, "", hidden, prompts) is None
    assert store.take("a", (0, 1), "", hidden, prompts) is None
    assert store.take("a", SPAN, "lora", hidden, prompts) is None
    assert store.take("a", SPAN, "", hidden, None) is None
    assert store.take("a", SPAN, "", hidden.to(torch.float16), prompts) is None
    assert store.take("a", SPAN, "", hidden, prompts * 2) is None
    got = store.take("a", SPAN, "", hidden.clone(), prompts.clone())
    assert got is not None and all(g is i for g, i in zip(got, inputs, strict=True))
    assert store.take("a", SPAN, "", hidden, prompts) is None and store.nbytes == 0
    assert (store.hits, store.misses) == (1, 7)


def test_past_its_bytes_the_heaviest_clients_oldest_entry_goes_first() -> None:
    store = KeptActivations(10 * MIB)  # three entries of 3 MiB fit
    entries = [_entry(seed) for seed in range(4)]
    for owner, (hidden, inputs) in zip(["a", "b", "b", "a"], entries, strict=True):
        assert store.put(owner, SPAN, "", hidden, None, inputs)
    # the fourth evicted b's oldest (b held 6 MiB against a's 3), not the oldest of all (a's)
    assert len(store) == 3 and store.nbytes == 9 * MIB and store.evictions == 1
    assert store.take("b", SPAN, "", entries[1][0], None) is None
    assert store.take("a", SPAN, "", entries[0][0], None) is not None
    assert not store.put("a", SPAN, "", torch.zeros(11 * MIB // 4), None, [])  # larger than the whole store


def test_entries_expire_and_the_device_floor_is_kept() -> None:
    now = [0.0]
    free = [8 * MIB]
    store = KeptActivations(
        64 * MIB, keep_s=10.0, floor_bytes=4 * MIB, free_bytes=lambda: free[0], clock=lambda: now[0]
    )
    hidden, inputs = _entry(0)
    assert store.put("a", SPAN, "", hidden, None, inputs)  # 8 - 2 MiB of device bytes leaves the 4 MiB floor
    now[0] = 11.0
    assert store.take("a", SPAN, "", hidden, None) is None and len(store) == 0  # expired
    free[0] = 5 * MIB
    assert not store.put("a", SPAN, "", hidden, None, inputs)  # would leave 3 MiB: under the floor
    assert len(store) == 0

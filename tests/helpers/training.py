"""Shared pieces of the training-through-the-swarm tests: a loopback swarm serving every family's 2-layer tiny model
(the first family split over two servers, blocks 0:1 and 1:2, so that its forward and backward cross both; the
others on one server each: the split is the client's, the same for every family), the local `transformers`
reference of a prompt-tuned model (prefix as `inputs_embeds`, deep prompts added to each decoder layer's input)
with its gradients, and the check that compares the two."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from corolla.cli.demo import wait_for_coverage
from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
from corolla.models.registry import get_family
from corolla.server.backend import SpanBackend
from helpers.swarm import Swarm, bootstrapped, inprocess_servers
from helpers.tiny_models import hf_layers, make_tiny_model, tiny_config

PRE_SEQ_LEN = 3
IDS = torch.tensor([[3, 14, 15, 92, 65, 35], [8, 97, 9, 32, 38, 46]])
CLIENT = ClientConfig(max_retries=5, min_backoff_s=0.2, update_period_s=2.0)
RTOL = 1e-4  # relative L2 error of every gradient against transformers, fp32
SPLIT_SPANS = ("0:1", "1:2")
WHOLE_SPAN = ("0:2",)


def tiny_llama_span(num_blocks: int, device: str) -> SpanBackend:
    """A tiny random Llama span of `num_blocks` blocks, fp32 on `device` (norm weights near 1, others std 0.15: large
    enough that a wrong merge of clients' rows shows in the outputs), seeded: the same weights on every device."""
    torch.manual_seed(0)
    config = tiny_config("llama", num_blocks)
    blocks = {}
    for i in range(num_blocks):
        block = get_family(config).build_block(config, i)
        for p in block.parameters():
            torch.nn.init.normal_(p, mean=1.0 if p.ndim == 1 else 0.0, std=0.15)
        blocks[i] = block.to(device)
    return SpanBackend(blocks, config=config, dtype=torch.float32, device=device)


@contextmanager
def split_swarm(
    tmp_path_factory: pytest.TempPathFactory, families: Sequence[str]
) -> Iterator[tuple[Swarm, dict[str, Path]]]:
    """Tiny 2-layer models of `families`: the first served by two servers (0:1 and 1:2), each other by one server
    (0:2); all started at once, in this process (`inprocess_servers`: what they compute is under test, not their
    process; a server process costs an interpreter start-up, ~5 s of CPU). What a family adds to the check is its
    blocks, not another split."""
    models_dir = tmp_path_factory.mktemp("models")
    paths = {family: make_tiny_model(family, models_dir, num_layers=2) for family in families}
    with bootstrapped(tmp_path_factory.mktemp("swarm"), timeout_s=180) as swarm:
        spans = [
            (path, blocks)
            for i, path in enumerate(paths.values())
            for blocks in (SPLIT_SPANS if i == 0 else WHOLE_SPAN)
        ]
        with inprocess_servers(spans, tmp_path_factory.mktemp("cache"), swarm.initial_peers):
            yield swarm, paths


def reference_loss_and_grads(
    path: Path, model: Any, input_ids: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The causal-LM loss (labels = input_ids) of `transformers`' fp32 model at `path` with `model`'s tuned prompts
    and client-side weights, and the gradients of every client parameter of `model` that requires grad, keyed by
    `model`'s parameter names."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    layout = model.layout
    ours_to_hf = {"embeddings": layout.embeddings, "final_norm": layout.final_norm, "lm_head": layout.lm_head}
    if layout.embeddings_norm:
        ours_to_hf["embeddings_norm"] = layout.embeddings_norm
    hf_params = dict(hf.named_parameters())
    mapped: dict[str, torch.nn.Parameter] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            module, _, rest = name.partition(".")
            if module in ours_to_hf and param.requires_grad:
                target = hf_params[f"{ours_to_hf[module]}.{rest}"]
                target.copy_(param)  # the client may have trained them: the reference uses the same values
                mapped[name] = target
    hf.requires_grad_(False)
    for target in mapped.values():
        target.requires_grad_(True)

    tuning = model.prompt_tuning
    num_prefix, batch = tuning.pre_seq_len, input_ids.shape[0]
    prefix = tuning.prompt_embeddings.weight.detach().clone().requires_grad_(True)  # [P, H]
    deep = None
    handles = []
    if tuning.intermediate_prompt_embeddings is not None:
        deep = tuning.intermediate_prompt_embeddings.weight.detach().clone().requires_grad_(True)  # [P, L * H]
        per_layer = deep.view(num_prefix, tuning.num_blocks, -1).permute(1, 0, 2)  # [L, P, H]

        def add_prompt(index: int):
            def hook(_module, args, kwargs):
                hidden = args[0] if args else kwargs["hidden_states"]
                hidden = torch.cat([hidden[:, :num_prefix] + per_layer[index], hidden[:, num_prefix:]], dim=1)
                if args:
                    return (hidden, *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": hidden}

            return hook

        handles = [
            layer.register_forward_pre_hook(add_prompt(i), with_kwargs=True) for i, layer in enumerate(hf_layers(hf))
        ]
    try:
        embeds = hf.get_input_embeddings()(input_ids)  # [B, T, H], scaled as the family does
        inputs_embeds = torch.cat([prefix.unsqueeze(0).expand(batch, -1, -1), embeds], dim=1)  # [B, P + T, H]
        logits = hf(inputs_embeds=inputs_embeds, use_cache=False).logits[:, num_prefix:]  # [B, T, V]
    finally:
        for handle in handles:
            handle.remove()
    vocab = logits.shape[-1]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), input_ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {name: target.grad for name, target in mapped.items()}
    grads["prompt_tuning.prompt_embeddings.weight"] = prefix.grad
    if deep is not None:
        grads["prompt_tuning.intermediate_prompt_embeddings.weight"] = deep.grad
    return loss.detach(), grads


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (0 when both are zero)."""
    scale = float(b.norm())
    return float((a - b).norm()) / scale if scale else float(a.norm())


def check_family_gradients(swarm: Swarm, path: Path, *, split: bool) -> None:
    """A deep-prompt-tuned causal LM through `swarm`, every client weight trainable: loss and gradients of all of
    them equal `reference_loss_and_grads` (relative RTOL), each gradient non-zero."""
    with AutoDistributedModelForCausalLM.from_pretrained(
        path, initial_peers=swarm.initial_peers, client_config=CLIENT, tuning_mode="deep_ptune",
        pre_seq_len=PRE_SEQ_LEN,
    ) as model:  # fmt: skip
        # every server's record visible (on a loaded machine a record can lag the server's readiness)
        spans = wait_for_coverage(model.manager, 2, timeout_s=60)
        expected_spans = SPLIT_SPANS if split else WHOLE_SPAN
        assert {f"{s.start}:{s.end}" for s in spans} == set(expected_spans)  # a split model's calls cross both
        model.train().requires_grad_(True)
        torch.manual_seed(0)
        with torch.no_grad():  # deep prompts start at zero (Petals): give them values so their gradients matter
            model.prompt_tuning.prompt_embeddings.weight.mul_(0.3)
            model.prompt_tuning.intermediate_prompt_embeddings.weight.normal_(0, 0.3)
        loss = model(IDS, labels=IDS).loss
        loss.backward()
        expected_loss, expected = reference_loss_and_grads(path, model, IDS)
        torch.testing.assert_close(loss.detach(), expected_loss, rtol=RTOL, atol=0)
        grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
        assert set(grads) == set(expected)
        for name, grad in grads.items():
            assert grad is not None and float(grad.norm()) > 0, name
            assert relative_error(grad, expected[name]) <= RTOL, (name, relative_error(grad, expected[name]))

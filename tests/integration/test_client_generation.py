"""Client through a loopback swarm of two servers (tiny Llama, blocks 0:2 and 2:4): logits, greedy, sampling,
padded batches and continued sessions equal local `transformers`; RemoteSequential forward/backward (with and
without deep prompts) equal local blocks; `corolla-generate` streams text; `pipeline("text-generation")`, `dtype=` and
`stop_strings` behave as in transformers."""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import pytest
import torch
from tests.helpers.swarm import bootstrapped, inprocess_servers
from transformers import AutoTokenizer, pipeline

from corolla.client import AutoDistributedModelForCausalLM, ClientConfig, RemoteSequential
from corolla.models.config import load_config
from corolla.models.loading import load_pretrained_block

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def swarm(model_path, tmp_path_factory: pytest.TempPathFactory):
    """A bootstrap node and two servers in this process (what they compute is under test, not their process: two
    interpreter start-ups less)."""
    with bootstrapped(tmp_path_factory.mktemp("swarm")) as swarm:
        spans = [(model_path, blocks) for blocks in ("0:2", "2:4")]
        cache_dir = tmp_path_factory.mktemp("cache")
        with inprocess_servers(spans, cache_dir, swarm.initial_peers):
            yield swarm


@pytest.fixture(scope="module")
def model(swarm, model_path):
    config = ClientConfig(max_retries=3, min_backoff_s=0.2, update_period_s=5.0)
    with AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=swarm.initial_peers, client_config=config
    ) as model:
        yield model


PROMPT = torch.tensor([[1, 17, 42, 99, 7, 250, 31]])


def test_logits_and_greedy_match_local_transformers(model, local):
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in local.parameters()) / 2
    with torch.no_grad():
        torch.testing.assert_close(model(PROMPT).logits, local(PROMPT).logits, atol=1e-3, rtol=0)
        expected = local.generate(PROMPT, max_new_tokens=24, do_sample=False)
    assert model.generate(PROMPT, max_new_tokens=24, do_sample=False).tolist() == expected.tolist()


def test_sampling_with_seed_and_repetition_penalty_matches(model, local):
    kwargs = dict(max_new_tokens=16, do_sample=True, temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.3)
    torch.manual_seed(123)
    with torch.no_grad():
        expected = local.generate(PROMPT, **kwargs)
    torch.manual_seed(123)
    assert model.generate(PROMPT, **kwargs).tolist() == expected.tolist()
    with torch.no_grad():
        greedy_penalized = local.generate(PROMPT, max_new_tokens=12, do_sample=False, repetition_penalty=1.5)
    assert model.generate(PROMPT, max_new_tokens=12, repetition_penalty=1.5).tolist() == greedy_penalized.tolist()


def test_left_padded_batch_matches_local(model, local):
    pad = 0
    ids = torch.tensor([[pad, pad, 5, 6, 7], [1, 2, 3, 4, 5], [pad, 9, 8, 7, 6]])
    mask = (ids != pad).long()
    mask[1] = 1
    with torch.no_grad():
        expected = local.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=pad)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=pad)
    assert got.tolist() == expected.tolist()


def test_two_generate_calls_in_one_session_continue_the_text(model, local):
    with torch.no_grad():
        expected = local.generate(PROMPT, max_new_tokens=16, do_sample=False)
    with model.inference_session(max_length=32) as session:
        first = model.generate(PROMPT, max_new_tokens=6, session=session)
        second = model.generate(None, max_new_tokens=10, session=session)
        assert session.position == PROMPT.shape[1] + 15  # the last token is pending until the next call
    assert torch.cat([first, second], dim=1).tolist() == expected.tolist()
    # new user tokens appended between calls
    extra = torch.tensor([[11, 12]])
    with torch.no_grad():
        full = local.generate(torch.cat([expected[:, :10], extra], dim=1), max_new_tokens=5, do_sample=False)
    with model.inference_session(max_length=32) as session:
        model.generate(PROMPT, max_new_tokens=3, session=session)
        continued = model.generate(extra, max_new_tokens=5, session=session)
    assert continued.tolist() == full[:, 10:].tolist()


def _local_blocks(model_path, start, end):
    config = load_config(str(model_path))
    return [load_pretrained_block(model_path, i, config=config, torch_dtype=torch.float32) for i in range(start, end)]


@pytest.mark.parametrize("with_prompts", [False, True])
def test_remote_sequential_forward_backward_equal_local(model, model_path, with_prompts):
    torch.manual_seed(0)
    blocks = _local_blocks(model_path, 1, 4)
    remote = RemoteSequential(model.manager)[1:4]  # spans two servers, starts mid-span
    hidden = model.config.hidden_size
    inputs = torch.randn(2, 5, hidden, requires_grad=True)
    prompts = torch.randn(3, 1, 2, hidden, requires_grad=True) if with_prompts else None
    grad = torch.randn(2, 5, hidden)

    outputs = remote(inputs, prompts)
    outputs.backward(grad)
    ref_inputs = inputs.detach().clone().requires_grad_(True)
    ref_prompts = prompts.detach().clone().requires_grad_(True) if with_prompts else None
    x = ref_inputs
    for i, block in enumerate(blocks):
        if ref_prompts is not None:
            x = torch.cat([x[:, :2] + ref_prompts[i], x[:, 2:]], dim=1)
        x = block(x)
    x.backward(grad)
    torch.testing.assert_close(outputs, x, atol=1e-4, rtol=0)
    torch.testing.assert_close(inputs.grad, ref_inputs.grad, atol=1e-4, rtol=0)
    if with_prompts:
        torch.testing.assert_close(prompts.grad, ref_prompts.grad, atol=1e-4, rtol=0)


def test_remote_sequential_inference_session_and_large_payload_stream(model, model_path):
    blocks = _local_blocks(model_path, 0, 4)
    remote = RemoteSequential(model.manager)
    hidden = model.config.hidden_size
    big = torch.randn(4, 1100, hidden)  # > 1 MiB: goes through rpc_forward_stream
    with torch.no_grad():
        x = big
        for block in blocks:
            x = block(x)
        torch.testing.assert_close(remote(big), x, atol=1e-4, rtol=0)
        steps = torch.randn(1, 4, hidden)
        prompts = torch.randn(4, 1, 2, hidden)  # deep prompts, applied to the first 2 positions at every block
        with remote.inference_session(max_length=8):
            out = torch.cat([remote(steps[:, :3], prompts), remote(steps[:, 3:])], dim=1)
        x = steps
        for i, block in enumerate(blocks):
            x = block(torch.cat([x[:, :2] + prompts[i], x[:, 2:]], dim=1))
    torch.testing.assert_close(out, x, atol=1e-3, rtol=0)


def test_corolla_generate_cli_streams_text(swarm, model_path):
    from corolla.cli.generate import main

    out = io.StringIO()
    with redirect_stdout(out):
        code = main(
            [str(model_path), "--max_new_tokens", "8", "--initial_peers", *swarm.initial_peers, "the quick brown"]
        )
    assert code == 0
    text = out.getvalue()
    assert text.startswith("the quick brown") and "8 tokens in" in text and "tokens/s" in text


def test_corolla_generate_interactive_keeps_one_session(swarm, model_path, monkeypatch):
    from corolla.cli.generate import main

    lines = iter(["hello there", "and then", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(
            [str(model_path), "--interactive", "--initial_peers", *swarm.initial_peers, "--max_new_tokens", "4"]
        )
    assert code == 0
    assert out.getvalue().count("tokens/s]") == 2


# --- where transformers users put a model: pipeline("text-generation"), dtype=, stop_strings ---
HF_PROMPT = "The swarm"


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return AutoTokenizer.from_pretrained(model_path)


def test_text_generation_pipeline_matches_local(model, local, tokenizer):
    kwargs = dict(max_new_tokens=8, do_sample=False)
    ours = pipeline("text-generation", model=model, tokenizer=tokenizer)(HF_PROMPT, **kwargs)
    theirs = pipeline("text-generation", model=local, tokenizer=tokenizer)(HF_PROMPT, **kwargs)
    assert ours == theirs
    assert ours[0]["generated_text"].startswith(HF_PROMPT) and len(ours[0]["generated_text"]) > len(HF_PROMPT)


def test_stop_strings_stop_where_transformers_stops(model, local, tokenizer):
    ids = tokenizer(HF_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        full = local.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)[0, ids.shape[1] :]
    text = tokenizer.decode(full, skip_special_tokens=True)
    # a stop string from the middle of the greedy text: two whole tokens' worth of printable characters
    pieces = [tokenizer.decode(full[i : i + 2]) for i in range(2, len(full) - 4)]
    stop = next(p for p in pieces if p.isprintable() and p.strip() and text.index(p) > 0)
    with torch.no_grad():
        theirs = local.generate(ids, max_new_tokens=16, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    ours = model.generate(ids, max_new_tokens=16, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    assert ours.tolist() == theirs.tolist()
    assert ours.shape[1] < ids.shape[1] + 16  # it did stop early
    assert tokenizer.decode(ours[0, ids.shape[1] :]).endswith(stop)

    with pytest.raises(ValueError, match="tokenizer"):
        model.generate(ids, max_new_tokens=4, stop_strings=[stop])
    with pytest.raises(ValueError, match="bad_words_ids"):
        model.generate(ids, max_new_tokens=4, bad_words_ids=[[5]])


def test_dtype_alias_of_torch_dtype(swarm, model_path):
    with AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=swarm.initial_peers, dtype=torch.bfloat16
    ) as model:
        assert model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="not both"):
        AutoDistributedModelForCausalLM.from_pretrained(
            model_path, initial_peers=swarm.initial_peers, dtype=torch.bfloat16, torch_dtype=torch.float16
        )

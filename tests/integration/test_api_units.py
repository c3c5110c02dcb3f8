"""The gateway's pure parts (no network): stop cutting and incremental detokenization, sampling, chat prompts."""

from __future__ import annotations

import pytest
import torch

from corolla.api.backend import TokenizerCodec, plain_chat_prompt
from corolla.api.sampling import SamplingParams, pick
from corolla.api.textstream import TextStream
from corolla.swarm.local import even_block_ranges
from helpers.tiny_models import build_tokenizer


def run(stream: TextStream, tokens: list[int]) -> tuple[list[str], bool]:
    pieces, stopped = [], False
    for t in tokens:
        piece, stopped = stream.push(t)
        pieces.append(piece)
        if stopped:
            break
    if not stopped:
        pieces.append(stream.finish())
    return pieces, stopped


def test_stop_spanning_tokens_is_held_back_then_cut():
    vocab = ["ab", "c<", "/s", ">tail"]
    stream = TextStream(lambda ids: "".join(vocab[i] for i in ids), stops=["</s>"])
    pieces, stopped = run(stream, [0, 1, 2, 3])
    assert stopped and stream.text == "abc"
    assert pieces == ["ab", "c", "", ""]  # "<" and "</s" waited: they might start the stop string


def test_false_alarm_is_released():
    vocab = ["x<", "/y", "z"]
    stream = TextStream(lambda ids: "".join(vocab[i] for i in ids), stops=["</s>"])
    pieces, stopped = run(stream, [0, 1, 2])
    assert not stopped and "".join(pieces) == stream.text == "x</yz"
    assert pieces[0] == "x"


def test_incomplete_utf8_waits_for_its_last_byte():
    tokenizer = build_tokenizer()
    ids = tokenizer("é€!", add_special_tokens=False)["input_ids"]  # one token per byte: 2 + 3 + 1
    assert len(ids) == 6
    stream = TextStream(lambda t: tokenizer.decode(t), stops=[])
    pieces, _ = run(stream, ids)
    assert "".join(pieces) == "é€!"
    assert all("\ufffd" not in p for p in pieces)


def test_earliest_of_several_stops_wins_and_empty_stop_rejected():
    stream = TextStream(lambda ids: "hello world"[: len(ids)], stops=["world", "lo"])
    run(stream, list(range(11)))
    assert stream.text == "hel"
    with pytest.raises(ValueError):
        TextStream(lambda ids: "", stops=[""])


def test_sampling():
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    assert pick(logits, SamplingParams(max_new_tokens=1, temperature=0.0), torch.Generator()) == 1
    # top_p small enough keeps only the most likely token even at high temperature
    narrow = SamplingParams(max_new_tokens=1, temperature=2.0, top_p=0.01, seed=3)
    assert {pick(logits, narrow, narrow.make_generator()) for _ in range(20)} == {1}
    seeded = SamplingParams(max_new_tokens=1, temperature=1.5, seed=7)
    g1, g2 = seeded.make_generator(), seeded.make_generator()
    assert [pick(logits, seeded, g1) for _ in range(30)] == [pick(logits, seeded, g2) for _ in range(30)]
    assert len({pick(logits, seeded, g1) for _ in range(200)}) >= 2  # really samples
    for bad in (dict(max_new_tokens=0), dict(max_new_tokens=1, temperature=-1), dict(max_new_tokens=1, top_p=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_chat_prompt_template_and_fallback():
    tokenizer = build_tokenizer()
    messages = [{"role": "user", "content": "hi"}]
    codec = TokenizerCodec(tokenizer, max_context_tokens=128)
    assert codec.chat_prompt_ids(messages) == tokenizer(plain_chat_prompt(messages))["input_ids"]
    assert plain_chat_prompt(messages) == "user: hi\nassistant:"

    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    ids = codec.chat_prompt_ids(messages)
    assert tokenizer.decode(ids) == "<s><|user|>hi<|assistant|>"
    assert ids.count(tokenizer.bos_token_id) == 1  # the template's BOS is not doubled
    assert codec.eos_token_ids == {tokenizer.eos_token_id}


def test_local_swarm_splits_blocks_evenly():  # `corolla-api --new_swarm N`'s split
    assert even_block_ranges(8, 3) == [(0, 3), (3, 5), (5, 8)]
    assert even_block_ranges(2, 4) == [(0, 1), (1, 2)]  # never an empty span
    with pytest.raises(ValueError):
        even_block_ranges(8, 0)

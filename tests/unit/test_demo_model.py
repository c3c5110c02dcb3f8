"""The demo model's pieces: the byte-level tokenizer, the training text, seeded training and the committed checkpoint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from corolla.demo.checkpoint import DEMO_CHECKPOINT_DIR, is_complete
from corolla.demo.corpus import prose_paragraphs
from corolla.demo.tokenizer import VOCAB_SIZE, build_byte_tokenizer
from corolla.demo.train import TRAINING_INFO_FILE, DemoTrainConfig, train_demo_model
from corolla.swarm.local import even_block_ranges


def test_tokenizer_is_one_token_per_byte_and_round_trips(tmp_path: Path) -> None:
    build_byte_tokenizer().save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)  # as servers and clients load it
    text = "Hello,  world!\n\tcaf\u00e9 \u2603 end"
    ids = tokenizer(text)["input_ids"]
    assert ids == [256, *text.encode("utf-8")]  # <s>, then one id per UTF-8 byte
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (256, 257, 258)
    assert len(tokenizer) == VOCAB_SIZE == 259
    every_byte = bytes(range(256)).decode("latin-1")
    assert tokenizer.decode(tokenizer(every_byte)["input_ids"][1:]) == every_byte


def test_tokenizer_maps_each_byte_to_its_value() -> None:
    tokenizer = build_byte_tokenizer()
    data = "a \u00e9\n~"
    assert tokenizer(data, add_special_tokens=False)["input_ids"] == list(data.encode("utf-8"))


def test_corpus_is_ascii_prose() -> None:
    paragraphs = prose_paragraphs()
    assert len(paragraphs) > 500 and sum(map(len, paragraphs)) > 100_000
    assert len(set(paragraphs)) == len(paragraphs)
    for paragraph in paragraphs:
        assert paragraph.isascii() and "\n" not in paragraph and len(paragraph) >= 80
    words = re.findall(r"[A-Za-z]+", " ".join(paragraphs[:50]))
    assert {"the", "is", "of"} <= set(words)


def test_training_is_deterministic(tmp_path: Path) -> None:
    config = DemoTrainConfig(hidden_size=32, num_layers=2, intermediate_size=64, num_heads=4, num_kv_heads=2,
                             seq_len_tokens=32, batch_size=4, num_steps=3, warmup_steps=1)  # fmt: skip
    first = train_demo_model(tmp_path / "a", config)
    second = train_demo_model(tmp_path / "b", config)
    weights_a, weights_b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        assert torch.equal(weights_a[name], weights_b[name]), name
    info = json.loads((first / TRAINING_INFO_FILE).read_text())
    assert info["config"]["num_steps"] == 3 and info["num_params"] > 0


@pytest.mark.parametrize(
    ("num_blocks", "num_servers", "expected"),
    [(4, 2, ((0, 2), (2, 4))), (5, 2, ((0, 2), (2, 5))), (6, 3, ((0, 2), (2, 4), (4, 6))), (3, 1, ((0, 3),))],
)
def test_split_blocks(num_blocks: int, num_servers: int, expected: tuple[tuple[int, int], ...]) -> None:
    assert tuple(even_block_ranges(num_blocks, num_servers)) == expected


def test_more_servers_than_blocks_start_one_server_per_block() -> None:
    assert even_block_ranges(4, 5) == [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.mark.skipif(not is_complete(DEMO_CHECKPOINT_DIR), reason="demo checkpoint is not built")
def test_committed_checkpoint_writes_words() -> None:
    from transformers import LlamaForCausalLM

    size_bytes = sum(path.stat().st_size for path in DEMO_CHECKPOINT_DIR.iterdir())
    assert size_bytes <= 15 * 10**6
    tokenizer = AutoTokenizer.from_pretrained(DEMO_CHECKPOINT_DIR)
    model = LlamaForCausalLM.from_pretrained(DEMO_CHECKPOINT_DIR).eval()
    ids = tokenizer("The value of", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=60, do_sample=False, repetition_penalty=1.1)
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    words = re.findall(r"[a-z]+", text)
    assert text.isascii() and len(words) >= 6, repr(text)
    common = {"the", "a", "of", "is", "to", "and", "in", "an", "be", "that", "for", "it", "as", "are", "or", "if"}
    assert common & set(words), repr(text)

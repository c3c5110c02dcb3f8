"""The benchmark's model: a random-weight Llama checkpoint with a word-level tokenizer (one token per word of a fixed
vocabulary, whitespace-split), so that an answer's text re-sent in the next turn encodes to the very tokens that were
generated (a byte-level tokenizer would re-split a random model's output and hide the reuse of answers)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

SPECIAL = ("<pad>", "<s>", "</s>", "<unk>")
ROLE_WORDS = ("system:", "user:", "assistant:")


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int = 512
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 1376
    vocab_words: int = 2000
    max_position_embeddings: int = 4096


def vocabulary(shape: ModelShape) -> list[str]:
    """The plain words (tokens) prompts and answers are made of."""
    return [f"w{i}" for i in range(shape.vocab_words)]


def word_ids(path: str | Path) -> list[int]:
    """Token ids of the plain words of a written checkpoint (the only tokens an answer may use)."""
    vocab = json.loads((Path(path) / "word_vocab.json").read_text())
    return [i for word, i in vocab.items() if word not in SPECIAL and word not in ROLE_WORDS]


def write_checkpoint(out: str | Path, shape: ModelShape, *, seed: int = 0) -> Path:
    """Writes config, random weights (std 0.02) and the tokenizer to `out` (skipped when already there)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out)
    if (out / "word_vocab.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    words = [*SPECIAL, *ROLE_WORDS, *vocabulary(shape)]
    vocab = {word: i for i, word in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    config = LlamaConfig(
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size,
        vocab_size=len(vocab),
        max_position_embeddings=shape.max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "word_vocab.json").write_text(json.dumps(vocab))
    return out

"""An offline byte-level tokenizer: one token per byte (ids 0-255) plus `<s>`, `</s>` and `<pad>`."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<s>", "</s>", "<pad>"
NUM_BYTE_TOKENS = 256
VOCAB_SIZE = NUM_BYTE_TOKENS + 3  # bytes, then bos=256, eos=257, pad=258


def _byte_symbols() -> list[str]:
    """The printable stand-in character of each byte value used by byte-level pre-tokenizers (index = byte)."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    direct = [b for b in range(NUM_BYTE_TOKENS) if chr(b) in alphabet]
    symbols: dict[int, str] = {b: chr(b) for b in direct}
    # bytes without a printable look-alike map, in byte order, to code points from 256 up
    shifted = [b for b in range(NUM_BYTE_TOKENS) if b not in symbols]
    for offset, b in enumerate(shifted):
        symbols[b] = chr(NUM_BYTE_TOKENS + offset)
    assert set(symbols.values()) == alphabet, "byte-level alphabet differs from the GPT-2 byte mapping"
    return [symbols[b] for b in range(NUM_BYTE_TOKENS)]


def build_byte_tokenizer(model_max_length_tokens: int = 2048) -> PreTrainedTokenizerFast:
    """Builds the tokenizer offline; encoding prepends `<s>`, token id i < 256 stands for byte i."""
    vocab = {symbol: byte for byte, symbol in enumerate(_byte_symbols())}
    vocab.update({BOS_TOKEN: 256, EOS_TOKEN: 257, PAD_TOKEN: 258})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([BOS_TOKEN, EOS_TOKEN, PAD_TOKEN])
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, 256)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=model_max_length_tokens,
        padding_side="left",
    )

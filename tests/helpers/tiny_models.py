"""Tiny random checkpoints for every family, built offline with transformers (safetensors, optionally sharded)
plus a byte-level tokenizer built with `tokenizers`; cached per process so repeated calls only copy files."""

from __future__ import annotations

import atexit
import contextlib
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

FAMILIES = ("llama", "mistral", "qwen2", "mixtral", "falcon", "falcon_mq", "bloom")
HIDDEN_SIZE = 64
VOCAB_SIZE = 300
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SHARD_SIZE = "60KB"  # with sharded=True: several shards per model, so a block's tensors sit in a few of them

_lock = threading.Lock()
_cache_root: Path | None = None
# More tiny families registered by other helper modules: name -> (num_layers -> transformers config).
EXTRA_FAMILIES: dict[str, Callable[[int], Any]] = {}


def register_tiny_family(name: str, build_config: Callable[[int], Any]) -> None:
    """Makes `tiny_config(name)` / `make_tiny_model(name, ...)` build `build_config(num_layers)` (not in FAMILIES,
    so the suites parametrized over FAMILIES do not pick it up)."""
    EXTRA_FAMILIES[name] = build_config


def common_config(num_layers: int) -> dict:
    """Config fields every tiny family shares (ids, sizes, init scale)."""
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        initializer_range=0.15,  # larger than the default so attention patterns (and position bugs) show
        tie_word_embeddings=False,
    )


def tiny_config(family: str, num_layers: int = 4):
    """The transformers config of a tiny model of `family` (see FAMILIES)."""
    import transformers as tf

    if family in EXTRA_FAMILIES:
        return EXTRA_FAMILIES[family](num_layers)
    c = common_config(num_layers)
    llama_like = dict(intermediate_size=128, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
    if family == "llama":
        return tf.LlamaConfig(**c, **llama_like)
    if family == "mistral":
        return tf.MistralConfig(**c, **llama_like, sliding_window=12)
    if family == "qwen2":
        return tf.Qwen2Config(**c, **llama_like, use_sliding_window=False)
    if family == "mixtral":
        return tf.MixtralConfig(
            **c, **{**llama_like, "intermediate_size": 96}, num_local_experts=4, num_experts_per_tok=2
        )
    if family == "falcon":
        return tf.FalconConfig(
            **c, num_kv_heads=2, new_decoder_architecture=True, parallel_attn=True, bias=False, alibi=False
        )
    if family == "falcon_mq":
        return tf.FalconConfig(
            **c, new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=False, alibi=False
        )
    if family == "bloom":
        c = {k: v for k, v in c.items() if k not in ("num_hidden_layers", "num_attention_heads")}
        return tf.BloomConfig(**c, n_layer=num_layers, n_head=4)
    raise ValueError(f"Unknown tiny family {family!r}; choose from {FAMILIES}")


def build_tokenizer():
    """A byte-level BPE tokenizer (every byte is a token, no merges) with <pad>=0, <s>=1, </s>=2; adds <s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", clean_up_tokenization_spaces=False
    )


def _build(family: str, out: Path, *, num_layers: int, sharded: bool, dtype: torch.dtype, seed: int) -> None:
    save_tiny_model(tiny_config(family, num_layers), out, sharded=sharded, dtype=dtype, seed=seed)


def save_tiny_model(config, out: str | Path, *, sharded: bool = False, dtype=torch.float32, seed: int = 0) -> Path:
    """Builds a random causal LM from any transformers `config` and saves it with the tiny tokenizer into `out`
    (for variants that `make_tiny_model` does not cover: rope scaling, ALiBi Falcon, ...)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    model.config.dtype = dtype
    kwargs = {"max_shard_size": SHARD_SIZE} if sharded else {"max_shard_size": "10GB"}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    build_tokenizer().save_pretrained(out)
    return Path(out)


def model_dir_name(family: str, *, num_layers: int = 4, sharded: bool = False, dtype=torch.float32, seed: int = 0):
    parts = [f"tiny-{family.replace('_', '-')}"]
    if num_layers != 4:
        parts.append(f"{num_layers}l")
    if sharded:
        parts.append("sharded")
    if dtype != torch.float32:
        parts.append(str(dtype).removeprefix("torch."))
    if seed != 0:
        parts.append(f"s{seed}")
    return "-".join(parts)


def make_tiny_model(
    family: str,
    directory: str | Path,
    *,
    num_layers: int = 4,
    sharded: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Path:
    """Writes a tiny random `family` model (config.json, safetensors weights, tokenizer) into a new folder
    `directory/<name>` (name like `tiny-llama`, `tiny-falcon-mq-sharded`) and returns that folder's path.
    `AutoTokenizer.from_pretrained(path)` and `AutoModelForCausalLM.from_pretrained(path)` work offline.
    Same arguments give the same weights (built once per process, then copied)."""
    global _cache_root
    if family not in FAMILIES and family not in EXTRA_FAMILIES:
        raise ValueError(f"Unknown tiny family {family!r}; choose from {FAMILIES + tuple(EXTRA_FAMILIES)}")
    name = model_dir_name(family, num_layers=num_layers, sharded=sharded, dtype=dtype, seed=seed)
    with _lock:
        if _cache_root is None:
            _cache_root = Path(tempfile.mkdtemp(prefix="corolla-tiny-models-"))
            atexit.register(shutil.rmtree, _cache_root, True)
        cached = _cache_root / name
        if not cached.exists():
            tmp = _cache_root / (name + ".partial")
            shutil.rmtree(tmp, ignore_errors=True)
            _build(family, tmp, num_layers=num_layers, sharded=sharded, dtype=dtype, seed=seed)
            tmp.rename(cached)
    target = Path(directory) / name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(cached, target, dirs_exist_ok=True)
    return target


def tiny_span_backend(span: tuple[int, ...], family: str = "llama", *, seed: int = 0):
    """A float32 CPU `SpanBackend` of random tiny `family` blocks at indices `span` (of a len(span)-layer config)."""
    from corolla.models.registry import get_family
    from corolla.server.backend import SpanBackend

    torch.manual_seed(seed)
    config = tiny_config(family, len(span))
    blocks = {i: get_family(config).build_block(config, i) for i in span}
    return SpanBackend(blocks, config=config, dtype=torch.float32, device="cpu")


def hf_model(model_path: str | Path):
    """transformers' causal LM of the checkpoint at `model_path`, float32, in eval mode: the reference of a swarm's
    outputs."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model_path: str | Path, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """`prompt` [B, T] followed by exactly `new_tokens` greedy tokens of `hf_model(model_path)`: [B, T + new]."""
    return hf_model(model_path).generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)


def hf_layers(model) -> torch.nn.ModuleList:
    """The decoder layers of a transformers causal LM (`model.layers`, `transformer.h`)."""
    for path in ("model.layers", "transformer.h", "h"):
        try:
            return model.get_submodule(path)
        except AttributeError:
            continue
    raise ValueError(f"Cannot find decoder layers in {type(model).__name__}")


@torch.no_grad()
def capture_hf_layer(model, layer_idx: int, input_ids: torch.Tensor):
    """Runs the whole transformers `model` on `input_ids` (no cache) and returns what its decoder layer
    `layer_idx` received and produced: (hidden_in [B,S,H], hidden_out [B,S,H], call_kwargs) — call_kwargs
    (masks, rotary embeddings, ALiBi) let a test call the reference layer again, e.g. for autograd."""
    layer = hf_layers(model)[layer_idx]
    seen = {}

    def pre_hook(_module, args, kwargs):
        seen["in"] = args[0] if args else kwargs["hidden_states"]
        seen["kwargs"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}

    def post_hook(_module, _args, output):
        seen["out"] = output[0] if isinstance(output, tuple) else output

    handles = [layer.register_forward_pre_hook(pre_hook, with_kwargs=True), layer.register_forward_hook(post_hook)]
    try:
        model(input_ids=input_ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen["in"].clone(), seen["out"].clone(), seen["kwargs"]


@contextlib.contextmanager
def torch_threads(n: int):
    """Tiny-model math is fastest single-threaded, above all on a loaded 2-core machine; restores on exit."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)

"""Distributed causal LMs: embeddings, final norm and LM head run locally (loaded alone from the checkpoint);
every transformer block runs on the swarm through `RemoteSequential`. `generate()` lives in `generation`."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutput

from corolla.client.checkpoint import CheckpointReader
from corolla.client.config import ClientConfig
from corolla.client.family_head import GEMMA_NORM, GPT_OSS_NORM, cap_logits, family_norm, scale_embeddings
from corolla.client.generation import GenerationLoop
from corolla.client.inference_session import InferenceSession
from corolla.client.remote_sequential import RemoteSequential
from corolla.client.routing import RemoteSequenceManager
from corolla.client.speculative_loop import SpeculativeStats
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class ClientLayout:
    """Where a family keeps the client-side modules in its checkpoint."""

    embeddings: str
    final_norm: str
    norm_kind: str  # "rms" or "layer"
    embeddings_norm: str | None = None
    lm_head: str = "lm_head"
    base_prefix: str = ""  # some checkpoints (bigscience/bloom) omit it


_RMS = ClientLayout(embeddings="model.embed_tokens", final_norm="model.norm", norm_kind="rms", base_prefix="model.")
_GEMMA = dataclasses.replace(_RMS, norm_kind=GEMMA_NORM)
LAYOUTS: dict[str, ClientLayout] = {
    "llama": _RMS,
    "mistral": _RMS,
    "qwen2": _RMS,
    "mixtral": _RMS,
    "qwen3": _RMS,
    "qwen3_moe": _RMS,
    "phi3": _RMS,
    "deepseek_v3": _RMS,
    "gemma2": _GEMMA,
    "gemma3_text": _GEMMA,
    "gpt_oss": dataclasses.replace(_RMS, norm_kind=GPT_OSS_NORM),
    "falcon": ClientLayout(
        embeddings="transformer.word_embeddings",
        final_norm="transformer.ln_f",
        norm_kind="layer",
        base_prefix="transformer.",
    ),
    "bloom": ClientLayout(
        embeddings="transformer.word_embeddings",
        embeddings_norm="transformer.word_embeddings_layernorm",
        final_norm="transformer.ln_f",
        norm_kind="layer",
        base_prefix="transformer.",
    ),
}


def _make_norm(kind: str, hidden_size: int, config: Any) -> nn.Module:
    if (family_specific := family_norm(kind, hidden_size, config)) is not None:
        return family_specific
    if kind == "rms":
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        return LlamaRMSNorm(hidden_size, eps=config.rms_norm_eps)
    return nn.LayerNorm(hidden_size, eps=config.layer_norm_epsilon)


class DistributedModelForCausalLM(nn.Module):
    """A causal LM whose blocks are served by the swarm. `forward(input_ids)` -> `CausalLMOutput(logits)`;
    `generate(...)` follows `transformers` argument names; `inference_session(max_length)` keeps state between
    calls (pass it as `session=` to continue a text)."""

    def __init__(self, config: Any, layout: ClientLayout, manager: RemoteSequenceManager):
        super().__init__()
        self.config, self.layout, self.manager = config, layout, manager
        hidden, vocab = config.hidden_size, config.vocab_size
        self.embeddings = nn.Embedding(vocab, hidden)
        self.embeddings_norm = _make_norm(layout.norm_kind, hidden, config) if layout.embeddings_norm else None
        self.transformer = RemoteSequential(manager)
        self.final_norm = _make_norm(layout.norm_kind, hidden, config)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.generation_config: Any = None
        self.speculative_stats: SpeculativeStats | None = None  # the last speculative generate()'s measurements

    @property
    def device(self) -> torch.device:
        return self.embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embeddings.weight.dtype

    def load_client_weights(self, reader: CheckpointReader) -> None:
        """Loads embeddings, norms and LM head only; ties the head to the embeddings when the checkpoint does."""
        modules: dict[str, nn.Module] = {
            self.layout.embeddings: self.embeddings,
            self.layout.final_norm: self.final_norm,
        }
        if self.layout.embeddings_norm and self.embeddings_norm is not None:  # built iff the layout names one
            modules[self.layout.embeddings_norm] = self.embeddings_norm
        wanted: dict[str, tuple[nn.Module, str]] = {}
        for prefix, module in modules.items():
            for param_name, _ in module.named_parameters():
                wanted[f"{prefix}.{param_name}"] = (module, param_name)
        names = list(wanted) + [self.layout.lm_head + ".weight"]
        stripped = {n: n.removeprefix(self.layout.base_prefix) for n in names if self.layout.base_prefix}
        tensors = reader.read(names + list(stripped.values()))
        for name in names:
            if name not in tensors and stripped.get(name) in tensors:
                tensors[name] = tensors[stripped[name]]
        missing = [name for name in wanted if name not in tensors]
        if missing:
            raise ValueError(f"checkpoint {reader.name_or_path} lacks client tensors {missing}")
        with torch.no_grad():
            for name, (module, param_name) in wanted.items():
                getattr(module, param_name).copy_(tensors[name])
            head = tensors.get(self.layout.lm_head + ".weight")
            if head is None or getattr(self.config, "tie_word_embeddings", False):
                self.lm_head.weight = self.embeddings.weight  # tied
            else:
                self.lm_head.weight.copy_(head)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = scale_embeddings(self.config, self.embeddings(input_ids.to(self.device)))  # [B, T, H]
        return self.embeddings_norm(hidden) if self.embeddings_norm is not None else hidden

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return cap_logits(self.config, self.lm_head(self.final_norm(hidden)))  # [B, T, V]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        prompts: torch.Tensor | None = None,
        session: InferenceSession | None = None,
    ) -> CausalLMOutput:
        """Logits `[B, T, V]`. Left-padded rows (attention_mask zeros) run without their padding; their padded
        positions get zero logits. With `session` (or inside an open one), steps it instead."""
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {list(input_ids.shape)}")
        session = session or self.transformer.active_session
        if session is not None:
            if attention_mask is not None and not bool(attention_mask.all()):
                raise ValueError("padded batches cannot step an inference session; use generate() or unpadded rows")
            return CausalLMOutput(logits=self.head(session.step(self.embed(input_ids), prompts)))
        if attention_mask is None or bool(attention_mask.all()):
            return CausalLMOutput(logits=self.head(self.transformer(self.embed(input_ids), prompts)))
        if prompts is not None:
            raise ValueError("deep prompts with padded batches are not supported")
        logits = torch.zeros(*input_ids.shape, self.config.vocab_size, dtype=self.dtype, device=self.device)
        for rows, pad in padding_groups(attention_mask):
            hidden = self.transformer(self.embed(input_ids[rows, pad:]))
            logits[rows, pad:] = self.head(hidden)
        return CausalLMOutput(logits=logits)

    def inference_session(self, max_length: int) -> InferenceSession:
        return self.transformer.inference_session(max_length=max_length)

    # what `transformers.pipeline("text-generation", model=this, tokenizer=...)` asks of a model
    main_input_name = "input_ids"
    input_modalities = ("text",)
    output_modalities = ("text",)

    @classmethod
    def can_generate(cls) -> bool:
        return True

    def generate(self, inputs: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """`transformers`-style generation (greedy, sampling with temperature/top-k/top-p/min-p, repetition penalty,
        `stop_strings` with `tokenizer=`, left-padded batches, `session=` to continue, `speculative=SpeculativeConfig(...)`
        for speculative decoding of one sequence; other arguments: ValueError). Returns prompt + new tokens ([B, L + N]); when continuing a
        session, the tokens after those of its previous calls."""
        return GenerationLoop(self).generate(inputs, **kwargs)

    def shutdown(self) -> None:
        self.manager.shutdown()

    def __enter__(self) -> DistributedModelForCausalLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def padding_groups(attention_mask: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """Groups rows of a left-padded mask `[B, L]` by padding length: [(row indices, pad length)]."""
    mask = attention_mask.bool()
    pads = (~mask).int().cumprod(dim=1).sum(dim=1)  # leading zeros per row
    for row, pad in enumerate(pads.tolist()):
        if not bool(mask[row, pad:].all()):
            raise ValueError("attention_mask must use left padding (zeros only before the first token)")
    return [(torch.nonzero(pads == pad).flatten(), int(pad)) for pad in sorted(set(pads.tolist()))]


class AutoDistributedModelForCausalLM:
    """Entry point: `AutoDistributedModelForCausalLM.from_pretrained(name_or_path, initial_peers=[...])`."""

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike,
        *,
        initial_peers: list[str] | tuple[str, ...] | None = None,
        dht_prefix: str | None = None,
        client_config: ClientConfig | None = None,
        dht: Any | None = None,
        torch_dtype: torch.dtype | str | None = None,
        dtype: torch.dtype | str | None = None,
        revision: str | None = None,
        token: str | bool | None = None,
        cache_dir: str | None = None,
    ) -> DistributedModelForCausalLM:
        """`dtype=` (transformers 5's spelling) or `torch_dtype=`: the dtype of the local embeddings and head (default
        float32; "auto" = the checkpoint's)."""
        from corolla.models.config import checkpoint_dtype, default_dht_prefix, load_config, parse_dtype
        from corolla.protocol.uids import make_uid

        if dtype is not None and torch_dtype is not None and dtype != torch_dtype:
            raise ValueError(f"pass dtype= or torch_dtype=, not both (got {dtype!r} and {torch_dtype!r})")
        torch_dtype = next((d for d in (dtype, torch_dtype) if d is not None), torch.float32)
        config = load_config(str(name_or_path), revision=revision, token=token, cache_dir=cache_dir)
        layout = LAYOUTS.get(config.model_type)
        if layout is None:
            raise ValueError(f"model_type {config.model_type!r} is not supported; supported: {sorted(LAYOUTS)}")
        client_config = dataclasses.replace(client_config) if client_config is not None else ClientConfig()
        if initial_peers is not None:
            client_config.initial_peers = tuple(initial_peers)
        prefix = dht_prefix or client_config.dht_prefix or default_dht_prefix(str(name_or_path), config)
        client_config.dht_prefix = prefix
        block_uids = [make_uid(prefix, i) for i in range(config.num_hidden_layers)]
        manager = RemoteSequenceManager(client_config, block_uids, dht=dht)
        try:
            model = DistributedModelForCausalLM(config, layout, manager)
            model.load_client_weights(
                CheckpointReader(name_or_path, revision=revision, token=token, cache_dir=cache_dir)
            )
            dtype = parse_dtype(torch_dtype) or checkpoint_dtype(config) or torch.float32  # "auto": the checkpoint's
            model.to(dtype)
            model.generation_config = _load_generation_config(name_or_path, config, revision, token, cache_dir)
        except BaseException:
            manager.shutdown()
            raise
        logger.info("distributed_model.ready(model=%s, prefix=%s, blocks=%d)", name_or_path, prefix, len(block_uids))
        return model.eval()


def _load_generation_config(name_or_path: Any, config: Any, revision: Any, token: Any, cache_dir: Any) -> Any:
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(name_or_path), revision=revision, token=token, cache_dir=cache_dir)
    except OSError:
        return GenerationConfig.from_model_config(config)

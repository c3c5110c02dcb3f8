"""Distributed models: embeddings, final norm, trainable prompts and the task head (here the causal LM's; sequence
classification in `sequence_classification`) run locally, loaded alone from the checkpoint; every transformer block
runs on the swarm through `RemoteSequential`. `generate()` lives in `generation`."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from transformers import GenerationConfig
from transformers.modeling_outputs import CausalLMOutput

from corolla.client.config import ClientConfig
from corolla.client.models.generation import GenerationLoop, padding_groups
from corolla.client.prefix.prefix_chain import PrefixChain, prompts_digest, session_root
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.session.inference_session import InferenceSession
from corolla.client.speculative.loop import SpeculativeStats
from corolla.client.training.prompt_tuning import PromptTuning, TuningConfig
from corolla.client.training.remote_sequential import RemoteSequential
from corolla.models.attention import softcap
from corolla.models.config import checkpoint_dtype, default_dht_prefix, load_config, parse_dtype
from corolla.models.layers import RMSNorm, RMSNormKind
from corolla.models.loading import CheckpointSource
from corolla.models.prequantized import PrequantizedFormat
from corolla.protocol.uids import make_uid
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class ClientLayout:
    """Where a family keeps the client-side modules in its checkpoint, and which norm they use."""

    embeddings: str
    final_norm: str
    norm_kind: RMSNormKind | Literal["layer"]  # an RMSNorm's kind, or "layer" (LayerNorm)
    embeddings_norm: str | None = None
    lm_head: str = "lm_head"
    base_prefix: str = ""  # some checkpoints (bigscience/bloom) omit it


_RMS = ClientLayout(embeddings="model.embed_tokens", final_norm="model.norm", norm_kind="llama", base_prefix="model.")
_GEMMA = dataclasses.replace(_RMS, norm_kind="gemma")
_FALCON = ClientLayout(
    embeddings="transformer.word_embeddings", final_norm="transformer.ln_f", norm_kind="layer",
    base_prefix="transformer.",
)  # fmt: skip
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
    "gpt_oss": dataclasses.replace(_RMS, norm_kind="gpt_oss"),
    "falcon": _FALCON,
    "bloom": dataclasses.replace(_FALCON, embeddings_norm="transformer.word_embeddings_layernorm"),
}


SCALED_EMBEDDINGS = ("gemma2", "gemma3_text")  # embeddings times sqrt(hidden_size), rounded to their dtype


def _make_norm(kind: RMSNormKind | Literal["layer"], hidden_size: int, config: Any) -> nn.Module:
    if kind == "layer":
        return nn.LayerNorm(hidden_size, eps=config.layer_norm_epsilon)
    return RMSNorm(hidden_size, config.rms_norm_eps, kind=kind)


class DistributedModel(nn.Module):
    """What every distributed model shares: embeddings (+ Bloom's embeddings norm), the remote blocks, the final norm
    and, with a `tuning_mode`, the trainable prompts (`prompt_tuning`). As in Petals, the checkpoint's client-side
    weights are frozen (`requires_grad=False`); the prompts and a task head added by a subclass are trainable, and
    gradients reach only them: the servers' blocks stay frozen and keep nothing between forward and backward."""

    def __init__(
        self, config: Any, layout: ClientLayout, manager: RemoteSequenceManager, tuning: TuningConfig | None = None
    ):
        super().__init__()
        self.config, self.layout, self.manager = config, layout, manager
        self.tuning = tuning or TuningConfig()
        config.tuning_mode, config.pre_seq_len = self.tuning.tuning_mode, self.tuning.pre_seq_len  # as Petals' config
        hidden = config.hidden_size
        self.embeddings = nn.Embedding(config.vocab_size, hidden)
        self.embeddings_norm = _make_norm(layout.norm_kind, hidden, config) if layout.embeddings_norm else None
        self.transformer = RemoteSequential(manager)
        self.final_norm = _make_norm(layout.norm_kind, hidden, config)
        self.requires_grad_(False)  # the checkpoint's weights; what is built after this line trains
        self.prompt_tuning = (
            PromptTuning(self.tuning, hidden_size=hidden, num_blocks=len(self.transformer))
            if self.tuning.enabled
            else None
        )

    @property
    def device(self) -> torch.device:
        return self.embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embeddings.weight.dtype

    @property
    def pre_seq_len(self) -> int:
        return self.tuning.pre_seq_len

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """Like `nn.Module.to`, except that the prompts stay float32 (their updates are small)."""
        super().to(*args, **kwargs)
        if self.prompt_tuning is not None:
            self.prompt_tuning.to(dtype=torch.float32)
        return self

    def client_modules(self) -> dict[str, nn.Module]:
        """Checkpoint prefix -> module, for the client-side modules this model loads."""
        modules: dict[str, nn.Module] = {
            self.layout.embeddings: self.embeddings,
            self.layout.final_norm: self.final_norm,
        }
        if self.layout.embeddings_norm and self.embeddings_norm is not None:  # built iff the layout names one
            modules[self.layout.embeddings_norm] = self.embeddings_norm
        return modules

    def load_client_weights(self, source: CheckpointSource) -> None:
        """Loads `client_modules()`' weights, then `load_head(tensors)` gets the tensors of `head_tensor_names()`."""
        wanted: dict[str, tuple[nn.Module, str]] = {}
        for prefix, module in self.client_modules().items():
            for param_name, _ in module.named_parameters():
                wanted[f"{prefix}.{param_name}"] = (module, param_name)
        names = list(wanted) + self.head_tensor_names()
        stripped = {n: n.removeprefix(self.layout.base_prefix) for n in names if self.layout.base_prefix}
        read = names + list(stripped.values())
        stored = PrequantizedFormat.of_config(self.config)  # a head bitsandbytes saved quantized is read as its codes
        tensors = source.read_named(read + (stored.statistics_names(read) if stored is not None else []))
        if stored is not None:
            tensors = stored.dequantized(tensors, self.dtype)
        for name in names:
            if name not in tensors and stripped.get(name) in tensors:
                tensors[name] = tensors[stripped[name]]
        missing = [name for name in wanted if name not in tensors]
        if missing:
            raise ValueError(f"checkpoint {source.name_or_path} lacks client tensors {missing}")
        with torch.no_grad():
            for name, (module, param_name) in wanted.items():
                param = getattr(module, param_name)
                if tensors[name].shape != param.shape:  # copy_ would broadcast a [1, H] tensor over [V, H]
                    raise ValueError(
                        f"checkpoint {source.name_or_path}: {name} is {list(tensors[name].shape)}, the config "
                        f"makes it {list(param.shape)}"
                    )
                param.copy_(tensors[name])
            self.load_head(tensors)

    def head_tensor_names(self) -> list[str]:
        return []

    def load_head(self, tensors: dict[str, torch.Tensor]) -> None:
        """Sets the task head from the checkpoint's tensors (those of `head_tensor_names()` it has)."""

    def embed(self, input_ids: torch.Tensor, prefix: torch.Tensor | None = None) -> torch.Tensor:
        """Input hidden states [B, P + T, H]: the (trainable) `prefix` [B, P, H] before the token embeddings (scaled as
        the family scales them), then Bloom's embeddings norm: prompts live where `transformers`' `inputs_embeds` do,
        as in Petals and PEFT."""
        hidden = self.embeddings(input_ids.to(self.device))  # [B, T, H]
        if self.config.model_type in SCALED_EMBEDDINGS:  # as the reference: sqrt(H) rounded to the dtype first
            hidden = hidden * torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype, device=hidden.device)
        if prefix is not None:
            hidden = torch.cat([prefix.to(hidden.dtype), hidden], dim=1)  # [B, P + T, H]
        return self.embeddings_norm(hidden) if self.embeddings_norm is not None else hidden

    def tuned_prompts(self, batch_size: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(prefix [B, P, H] or None, deep prompts [num_blocks, B, P, H] or None) of the tuning mode."""
        if self.prompt_tuning is None:
            return None, None
        return self.prompt_tuning(batch_size, self.dtype)

    def _deep_prompts(self, prompts: torch.Tensor | None, tuned: torch.Tensor | None) -> torch.Tensor | None:
        if prompts is not None and tuned is not None:
            raise ValueError("this model tunes its own deep prompts (tuning_mode='deep_ptune'); do not pass prompts=")
        return tuned if tuned is not None else prompts

    def run_blocks(self, input_ids: torch.Tensor, prompts: torch.Tensor | None = None) -> torch.Tensor:
        """Unpadded rows [B, T] through embeddings, prompts and the remote blocks: hidden states [B, T, H] before the
        final norm (the prefix positions removed). Differentiable wrt prompts and everything local."""
        prefix, tuned = self.tuned_prompts(input_ids.shape[0])
        hidden = self.transformer(self.embed(input_ids, prefix), self._deep_prompts(prompts, tuned))
        return hidden[:, self.pre_seq_len :]

    def session_step(
        self,
        session: InferenceSession,
        input_ids: torch.Tensor,
        prompts: torch.Tensor | None = None,
        *,
        may_reuse: bool = False,
    ) -> torch.Tensor:
        """One inference step of new tokens [B, T]: hidden states [B, T, H] before the final norm. A session's first
        step carries the tuned prompts (the prefix takes `pre_seq_len` positions of its cache). The positions are
        keyed by their tokens (`ClientConfig.prefix_reuse`); with `may_reuse`, a fresh session skips the prefix its
        servers hold, and the result holds the last `T - skipped` tokens only (`session.reused_tokens`)."""
        prefix = tuned = None
        ids = input_ids
        if session.position == 0:
            prefix, tuned = self.tuned_prompts(input_ids.shape[0])
            prompts = self._deep_prompts(prompts, tuned)
            session.prefix = None
            if self.manager.config.prefix_reuse and input_ids.shape[0] == 1:
                digest = prompts_digest(prefix, prompts)
                adapter = self.manager.config.active_adapter
                session.prefix = PrefixChain(session_root(self.manager.block_uids, adapter=adapter, prompts=digest))
            if prefix is not None:  # the tuned prefix's positions: ids no token has (the digest names the prompts)
                virtual = -torch.arange(1, prefix.shape[1] + 1, dtype=input_ids.dtype).expand(input_ids.shape[0], -1)
                ids = torch.cat([virtual, input_ids], dim=1)
        hidden = session.step(self.embed(input_ids, prefix), prompts, token_ids=ids, may_reuse=may_reuse)
        skipped = ids.shape[1] - hidden.shape[1]  # positions reused from the servers' caches
        if prefix is not None:
            return hidden[:, max(prefix.shape[1] - skipped, 0) :]
        return hidden

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states [B, T, H]; left-padded rows run without their padding (padded positions are
        zero)."""
        if attention_mask is None or bool(attention_mask.all()):
            return self.final_norm(self.run_blocks(input_ids))
        out = torch.zeros(*input_ids.shape, self.config.hidden_size, dtype=self.dtype, device=self.device)
        for rows, pad in padding_groups(attention_mask):
            out[rows, pad:] = self.final_norm(self.run_blocks(input_ids[rows, pad:]))
        return out

    def inference_session(self, max_length: int) -> InferenceSession:
        """A session for `max_length` tokens (plus the tuned prefix's `pre_seq_len`)."""
        return self.transformer.inference_session(max_length=max_length + self.pre_seq_len)

    def shutdown(self) -> None:
        self.manager.shutdown()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


class DistributedModelForCausalLM(DistributedModel):
    """A causal LM whose blocks are served by the swarm. `forward(input_ids, labels=...)` ->
    `CausalLMOutput(loss, logits)`; `generate(...)` follows `transformers` argument names; `inference_session(max_length)`
    keeps state between calls (pass it as `session=` to continue a text)."""

    def __init__(
        self, config: Any, layout: ClientLayout, manager: RemoteSequenceManager, tuning: TuningConfig | None = None
    ):
        super().__init__(config, layout, manager, tuning)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False).requires_grad_(False)
        self.generation_config: Any = None
        self.speculative_stats: SpeculativeStats | None = None  # the last speculative generate()'s measurements

    def head_tensor_names(self) -> list[str]:
        return [self.layout.lm_head + ".weight"]

    def load_head(self, tensors: dict[str, torch.Tensor]) -> None:
        """Ties the head to the embeddings when the checkpoint does (or has no head)."""
        head = tensors.get(self.layout.lm_head + ".weight")
        if head is None or getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.embeddings.weight  # tied
        elif head.shape != self.lm_head.weight.shape:
            raise ValueError(f"the checkpoint's head is {list(head.shape)}, the config makes it "
                             f"{list(self.lm_head.weight.shape)}")  # fmt: skip
        else:
            self.lm_head.weight.copy_(head)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.final_norm(hidden))  # [B, T, V]
        cap = getattr(self.config, "final_logit_softcapping", None)
        return logits if cap is None else softcap(logits, float(cap))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        prompts: torch.Tensor | None = None,
        session: InferenceSession | None = None,
    ) -> CausalLMOutput:
        """Logits `[B, T, V]` (and, with `labels` [B, T], the mean next-token cross-entropy over labels != -100, as
        `transformers` computes it). Left-padded rows (attention_mask zeros) run without their padding; their
        padded positions get zero logits. With `session` (or inside an open one), steps it instead."""
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {list(input_ids.shape)}")
        session = session or self.transformer.active_session
        if session is not None:
            if attention_mask is not None and not bool(attention_mask.all()):
                raise ValueError("padded batches cannot step an inference session; use generate() or unpadded rows")
            logits = self.head(self.session_step(session, input_ids, prompts))
        elif attention_mask is None or bool(attention_mask.all()):
            logits = self.head(self.run_blocks(input_ids, prompts))
        else:
            if prompts is not None:
                raise ValueError("deep prompts with padded batches are not supported")
            logits = torch.zeros(*input_ids.shape, self.config.vocab_size, dtype=self.dtype, device=self.device)
            for rows, pad in padding_groups(attention_mask):
                logits[rows, pad:] = self.head(self.run_blocks(input_ids[rows, pad:]))
        loss = causal_lm_loss(logits, labels) if labels is not None else None
        return CausalLMOutput(loss=loss, logits=logits)

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
        session, the tokens after those of its previous calls. With a `tuning_mode`, the tuned prompts go first."""
        return GenerationLoop(self).generate(inputs, **kwargs)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits [B, T, V] predicting labels [B, T] shifted by one (labels -100 ignored), in
    float32: what `transformers`' causal LMs return as `loss`."""
    if labels.shape != logits.shape[:2]:
        raise ValueError(f"labels must be [batch, tokens] = {list(logits.shape[:2])}, got {list(labels.shape)}")
    shifted = labels[:, 1:].to(logits.device).reshape(-1)  # [B * (T - 1)]
    return nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), shifted, ignore_index=-100
    )  # fmt: skip


def load_distributed_model(
    model_class: type[DistributedModel],
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
    tuning_mode: str | None = None,
    pre_seq_len: int = 0,
    **model_kwargs: Any,
) -> Any:
    """Builds `model_class(config, layout, manager, tuning, **model_kwargs)` for a checkpoint and loads its
    client-side weights (see `AutoDistributedModelForCausalLM.from_pretrained`)."""
    if dtype is not None and torch_dtype is not None and dtype != torch_dtype:
        raise ValueError(f"pass dtype= or torch_dtype=, not both (got {dtype!r} and {torch_dtype!r})")
    torch_dtype = next((d for d in (dtype, torch_dtype) if d is not None), torch.float32)
    tuning = TuningConfig(tuning_mode, pre_seq_len)  # ValueError before anything starts
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
        model = model_class(config, layout, manager, tuning, **model_kwargs)
        model.load_client_weights(CheckpointSource(name_or_path, revision=revision, token=token, cache_dir=cache_dir))
        model.to(parse_dtype(torch_dtype) or checkpoint_dtype(config) or torch.float32)  # "auto": the checkpoint's
        if isinstance(model, DistributedModelForCausalLM):
            model.generation_config = _load_generation_config(name_or_path, config, revision, token, cache_dir)
    except BaseException:
        manager.shutdown()
        raise
    logger.info(
        "distributed_model.ready(model=%s, class=%s, prefix=%s, blocks=%d, tuning_mode=%s, pre_seq_len=%d)",
        name_or_path, model_class.__name__, prefix, len(block_uids), tuning.tuning_mode, tuning.pre_seq_len,
    )  # fmt: skip
    return model.eval()


class AutoDistributedModelForCausalLM:
    """Entry point: `AutoDistributedModelForCausalLM.from_pretrained(name_or_path, initial_peers=[...])`."""

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, **kwargs: Any) -> DistributedModelForCausalLM:
        """Keyword arguments: `initial_peers`, `dht_prefix`, `client_config` (ClientConfig), `dht`, `revision`, `token`,
        `cache_dir`; `dtype=` (transformers 5's spelling) or `torch_dtype=`: the dtype of the local embeddings and
        head (default float32; "auto" = the checkpoint's); `tuning_mode=` "ptune" | "deep_ptune" with `pre_seq_len=`
        (Petals' prompt tuning: trainable prompts, see `client.training.prompt_tuning`). Returned in eval mode."""
        return load_distributed_model(DistributedModelForCausalLM, name_or_path, **kwargs)


def _load_generation_config(name_or_path: Any, config: Any, revision: Any, token: Any, cache_dir: Any) -> Any:
    try:
        return GenerationConfig.from_pretrained(str(name_or_path), revision=revision, token=token, cache_dir=cache_dir)
    except OSError:
        return GenerationConfig.from_model_config(config)

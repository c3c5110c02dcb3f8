"""Trains the demo model on CPU: a small Llama over bytes of Python's own prose, seeded so reruns give the same weights;
and its draft model for speculative decoding: the same trainer, corpus, tokenizer and seed in a much smaller shape, so
it is cheap to ship and retrains to the same weights.

Run `python -m corolla.demo.train [--draft] [--output_dir DIR]`; by default it rewrites the committed checkpoint (or
draft) under `assets/`.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from corolla.demo.corpus import prose_paragraphs
from corolla.demo.tokenizer import NUM_BYTE_TOKENS, VOCAB_SIZE, build_byte_tokenizer
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

BOS_ID, EOS_ID, PAD_ID = NUM_BYTE_TOKENS, NUM_BYTE_TOKENS + 1, NUM_BYTE_TOKENS + 2
TRAINING_INFO_FILE = "training_info.json"
DEMO_CHECKPOINT_DIR = Path(__file__).resolve().parent / "assets" / "corolla-demo-llama"
DEMO_DRAFT_DIR = DEMO_CHECKPOINT_DIR.parent / "corolla-demo-draft"


@dataclass(frozen=True)
class DemoTrainConfig:
    """Model shape and training schedule of the demo model (defaults: the committed checkpoint)."""

    hidden_size: int = 256
    num_layers: int = 4
    intermediate_size: int = 688
    num_heads: int = 8
    num_kv_heads: int = 4
    max_position_embeddings_tokens: int = 1024
    seq_len_tokens: int = 128
    batch_size: int = 32
    num_steps: int = 700
    peak_lr: float = 3e-3
    final_lr_share: float = 0.1
    warmup_steps: int = 60
    weight_decay: float = 0.05
    seed: int = 0
    num_threads: int = 1  # one thread: the same weights on any machine, and no spin-waiting when cores are busy
    validation_share: float = 0.03
    log_every_steps: int = 50

    def model_config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=VOCAB_SIZE, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, max_position_embeddings=self.max_position_embeddings_tokens,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
            bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        )  # fmt: skip


# ~0.4M parameters (the demo model has 3.0M): one draft token costs a few hundred microseconds on one CPU core
DRAFT_TRAIN_CONFIG = DemoTrainConfig(hidden_size=128, num_layers=2, intermediate_size=344, num_heads=4, num_kv_heads=2)


def _encode(paragraphs: list[str]) -> torch.Tensor:
    """All paragraphs as one byte stream, one paragraph per line. Returns int64 [num_bytes]."""
    data = "\n".join(paragraphs).encode("ascii")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def _sample_batch(data: torch.Tensor, config: DemoTrainConfig, generator: torch.Generator) -> torch.Tensor:
    """Random windows of the stream, each behind `<s>` as at generation time. Returns int64 [batch, seq_len]."""
    window = config.seq_len_tokens - 1
    starts = torch.randint(0, data.numel() - window, (config.batch_size,), generator=generator)
    rows = torch.stack([data[start : start + window] for start in starts.tolist()])  # [batch, seq_len - 1]
    bos = torch.full((config.batch_size, 1), BOS_ID, dtype=torch.long)
    return torch.cat([bos, rows], dim=1)


def _lr_at(step: int, config: DemoTrainConfig) -> float:
    """Linear warm-up, then cosine decay to `final_lr_share` of the peak."""
    if step < config.warmup_steps:
        return config.peak_lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.num_steps - config.warmup_steps)
    share = config.final_lr_share + (1 - config.final_lr_share) * 0.5 * (1 + math.cos(math.pi * progress))
    return config.peak_lr * share


@torch.no_grad()
def _validation_loss(model: LlamaForCausalLM, data: torch.Tensor, config: DemoTrainConfig) -> float:
    """Mean loss (nats per byte) over fixed windows of the held-out text."""
    model.eval()
    batch = _sample_batch(data, config, torch.Generator().manual_seed(config.seed + 1))
    loss = model(input_ids=batch, labels=batch).loss.item()
    model.train()
    return loss


def train_demo_model(output_dir: Path, config: DemoTrainConfig = DemoTrainConfig()) -> Path:
    """Trains from scratch and saves safetensors weights, config, tokenizer and `training_info.json` in `output_dir`."""
    torch.manual_seed(config.seed)
    torch.set_num_threads(config.num_threads)
    torch.use_deterministic_algorithms(True)
    paragraphs = prose_paragraphs()
    num_validation = max(1, int(len(paragraphs) * config.validation_share))
    train_data, validation_data = _encode(paragraphs[:-num_validation]), _encode(paragraphs[-num_validation:])

    model = LlamaForCausalLM(config.model_config())
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(f"train.start(params={num_params}, train_bytes={train_data.numel()}, steps={config.num_steps})")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.peak_lr,
        betas=(0.9, 0.98),
    )
    generator = torch.Generator().manual_seed(config.seed)
    started = time.perf_counter()
    model.train()
    train_loss = float("nan")
    for step in range(config.num_steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, config)
        batch = _sample_batch(train_data, config, generator)  # [batch, seq_len]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        train_loss = loss.item()
        if step % config.log_every_steps == 0 or step == config.num_steps - 1:
            elapsed = time.perf_counter() - started
            logger.info(
                f"train.step(step={step}, loss={train_loss:.3f}, lr={_lr_at(step, config):.2e}, elapsed_s={elapsed:.0f})"
            )
    training_time_s = time.perf_counter() - started
    validation_loss = _validation_loss(model, validation_data, config)
    logger.info(
        f"train.done(time_s={training_time_s:.0f}, loss={train_loss:.3f}, validation_loss={validation_loss:.3f})"
    )

    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir, safe_serialization=True)
    build_byte_tokenizer(config.max_position_embeddings_tokens).save_pretrained(output_dir)
    info = {
        "config": asdict(config),
        "num_params": num_params,
        "train_bytes": train_data.numel(),
        "validation_bytes": validation_data.numel(),
        "train_loss_nats_per_byte": round(train_loss, 4),
        "validation_loss_nats_per_byte": round(validation_loss, 4),
        "training_time_s": round(training_time_s, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    (output_dir / TRAINING_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return output_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--draft", action="store_true", help="the draft model (default: the demo model)")
    parser.add_argument("--output_dir", type=Path, default=None, help="default: its committed copy under assets/")
    parser.add_argument("--num_steps", type=int, default=DemoTrainConfig.num_steps)
    parser.add_argument("--seed", type=int, default=DemoTrainConfig.seed)
    args = parser.parse_args()
    config = replace(DRAFT_TRAIN_CONFIG if args.draft else DemoTrainConfig(), num_steps=args.num_steps, seed=args.seed)
    output_dir = args.output_dir or (DEMO_DRAFT_DIR if args.draft else DEMO_CHECKPOINT_DIR)
    train_demo_model(output_dir, config)


if __name__ == "__main__":
    main()

"""How far bf16 rounding alone moves the logits of a random 80-layer Llama whose projections have the same variance
gain as the two-GPU run's 70B-shaped checkpoint (fan-in x std^2 = 8192 x 0.02^2 = 3.3): transformers in float32 vs
transformers in bfloat16, on the CPU, at hidden 1024 (std sqrt(3.3 / 1024) = 0.0566). Run:
`python benchmarks/bf16_amplification.py [--std 0.0566] [--layers 80]`; prints the relative L2 of the last
position's logits and whether the argmax agrees. Used to read the two-GPU run's corolla-vs-transformers logits gap."""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--std", type=float, default=0.0566)
    p.add_argument("--layers", type=int, default=80)
    p.add_argument("--hidden", type=int, default=1024)
    args = p.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 7 // 2,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=1000,
        initializer_range=args.std,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, 16))
    with torch.no_grad():
        ref = model(ids).logits[0, -1].double()  # [V] float32 reference
        bf16 = model.to(torch.bfloat16)(ids).logits[0, -1].double()  # [V]
    rel = ((bf16 - ref).norm() / ref.norm()).item()
    print(
        f"layers={args.layers} hidden={args.hidden} std={args.std}: logit std {ref.std().item():.3f}, "
        f"bf16 vs float32 relative L2 {rel:.3f}, argmax equal {bool(bf16.argmax() == ref.argmax())}"
    )


if __name__ == "__main__":
    main()

"""DeepSeek-V3 (also Kimi K2): multi-head latent attention with a compressed KV cache, and a mixture of routed
plus shared experts with group-limited sigmoid routing after the first dense layers."""

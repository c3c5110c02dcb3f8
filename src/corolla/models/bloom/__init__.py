"""BLOOM family: ALiBi multi-head attention with a per-head fused q/k/v projection."""

"""Routed mixture-of-experts on the fast path: experts read in place and routers (`routed_experts`), their Triton kernels
(`moe_kernels`), quantized experts with their kernels (`moe_quant`, `moe_quant_kernels`), and the surface both
forms of experts share (`expert_set`)."""

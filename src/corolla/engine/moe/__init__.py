"""Routed mixture-of-experts on the fast path: experts read in place and routers (`moe`), their Triton kernels
(`moe_kernels`), quantized experts and their kernels (`moe_quant`, `moe_quant_kernels`), and the numerics check of
the Mixtral span against transformers (`moe_numerics`)."""

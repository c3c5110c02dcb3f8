"""Span models: the `span_model.SpanModel` seam and one model per kind of span behind it (`fast_llama` for the
llama family with routed experts, `fast_mla` for DeepSeek-V3's latent attention, `fast_dense` for Falcon and BLOOM,
`eager_span` for the families without fused kernels), with LoRA adapters on the fused path (`fast_lora`)."""

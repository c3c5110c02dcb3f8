"""The decode step's operations as the span models call them: each dispatches to a torch reference (CPU,
fallback; the paged decode attention's CPU version), a Triton kernel (`kernels/`) or a quantized GEMV/GEMM
(`quant/`): `decode_ops` (`DecodeOps`, the start-up tuner) and Falcon/BLOOM's glue (`dense_ops`)."""

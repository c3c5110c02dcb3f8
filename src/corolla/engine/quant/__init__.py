"""Quantized projections read in bitsandbytes' layouts in place: the weight records (`quant_weights`), the dequantizing
GEMV/GEMM kernels (`quant_gemv`, `quant_kernels`, `quant_mma`, NF4's one-row GEMV on the matrix units `quant_tile_gemv`, INT8's row GEMV on the matrix units `quant_int8_gemv`, with `kernels/quant_splits`' in-kernel
split-K sums and the NF4 decoders `quant_pair_table`, `quant_prmt`) and the start-up choice of kernel per shape
(`quant_choices`)."""

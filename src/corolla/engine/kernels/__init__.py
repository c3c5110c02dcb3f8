"""Kernels of the decode and prefill steps, each with its torch reference (CPU, tests): the decode step's Triton
kernels (`triton_kernels`), Falcon/BLOOM's (`dense_kernels`), the in-kernel split-K sums and prologues
shared with the quantized Triton kernels (`quant_splits`), the NVRTC launch path (`nvrtc_kernels`), DeepSeek-V3's
(`mla_kernels`, `mla_triton`), ALiBi, QK norm, paged attention for prefill chunks, CPU projections
chosen by measurement (`cpu_linear`), device timing of candidates (`graph_timing`) and the choices kept on disk
(`kernel_choices`)."""

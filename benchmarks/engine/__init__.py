"""The engine's spans on one card against their floors and `transformers`: `python -m benchmarks.engine.dense`
(Falcon, BLOOM), `.moe` (Mixtral), `.mla` (DeepSeek-V3), `.quant` (NF4, INT8, Qwen3), `.quant_probe` (the NF4
kernels per projection), `.lora` (adapters), `.cpu_linear` (the CPU projections' formulations)."""

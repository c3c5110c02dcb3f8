"""What a block is. `registry` maps `config.model_type` to a family folder (`llama` also serving Mistral and Qwen2,
`mixtral`, `falcon`, `bloom`), each holding its `CorollaBlock` (contract in `block_base`) built from shared parts:
`attention` (fused q/k/v, our KV cache layout, SDPA), `positions` (rotary, ALiBi) and `layers` (norms, MLPs, MoE).
Around the blocks: `config` (configs, dtype rule, DHT prefix), `loading` + `disk_cache` (only a block's own tensors,
shared LRU cache), `quantization`, `lora`, `tensor_parallel` and `sizing`. Never imports networking."""

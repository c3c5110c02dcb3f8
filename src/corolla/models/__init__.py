"""What a block is. `registry` maps `config.model_type` to a family folder (`llama` also serving Mistral, Qwen2 and
Qwen3; `mixtral`, `falcon`, `bloom`, `qwen3_moe`, `gemma`, `phi3`, `deepseek_v3`, `gpt_oss`), each holding its
`CorollaBlock` (contract in `block_base`) built from shared parts: `attention` (fused q/k/v, our
KV cache layout, SDPA), `positions` (rotary of every rope type, ALiBi) and `layers` (norms, MLPs, MoE). Around the
blocks: `config` (configs, dtype rule, DHT prefix), `loading` + `hub_files` + `disk_cache` (only a block's own
tensors, shared LRU cache), `quantization`, `placement`, `lora`, `tensor_parallel` and `sizing`.
Never imports networking."""

"""What several benches share: timers and copy bandwidth (`measure`), a random-weight Llama of a given shape and
corolla blocks holding its weights (`model`), the engine's step drivers (`engine_steps`, `batcher`), transformers'
decode step (`hf_steps`), the running report (`report`) and the environment of child processes (`children`)."""

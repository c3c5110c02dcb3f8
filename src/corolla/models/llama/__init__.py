"""Llama family: Llama 2/3/3.x (rope scaling), Mistral (sliding window) and Qwen2 (q/k/v biases) share one block."""

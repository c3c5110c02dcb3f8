"""CUDA graphs: whole-span decode steps per batch bucket (`cuda_graphs`) and short prefill chunks after a cached
prefix (`prefill_graphs`). The merged forward launched over the decode graphs is the engine's (`graph_decode`)."""

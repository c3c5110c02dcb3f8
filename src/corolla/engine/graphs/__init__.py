"""CUDA graphs: whole-span decode steps per batch bucket (`cuda_graphs`), a merged decode forward split into launch
and finish (`graph_decode`), and short prefill chunks after a cached prefix (`prefill_graphs`)."""

"""Mixtral family: the Llama attention with a sparse mixture-of-experts MLP (top-k routing)."""

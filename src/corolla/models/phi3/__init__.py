"""Phi-3 / Phi-4: the Llama layer with q/k/v and gate/up projections fused in the checkpoint."""

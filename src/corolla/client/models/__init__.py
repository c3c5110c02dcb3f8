"""Distributed models: local embeddings, norm and heads around remote blocks (`distributed_model`, with each
family's client-side layout; `sequence_classification`) and `generate()` (`generation`, left-padded batches too)."""

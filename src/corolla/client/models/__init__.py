"""Distributed models: local embeddings, norm and heads around remote blocks (`distributed_model`,
`sequence_classification`, the families' differences in `family_head`), reading only the named tensors of a
checkpoint (`checkpoint`), left-padded batches (`padding`) and `generate()` (`generation`)."""

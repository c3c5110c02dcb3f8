"""A model no single GPU holds (`python -m benchmarks.two_gpu`): a random 70B-shaped checkpoint
(`random_checkpoint`), two servers against `transformers` with `device_map="auto"` (`phases`), the table (`report`)."""

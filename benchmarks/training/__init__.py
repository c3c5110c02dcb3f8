"""Training through one server: forward+backward tokens/s at 1 and N concurrent clients, an inference session's step
meanwhile, and `transformers` running the same span locally (`python -m benchmarks.training`)."""

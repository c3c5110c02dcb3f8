"""The single-card bench (`python -m benchmarks.serving`): the HBM floor, `transformers` baselines (`hf_baseline`),
corolla's engine on the same weights, and with `--rpc` the client-observed step through a local server (`rpc`);
`report` writes the table, JSON and plot."""

"""Many users through one real server (`python -m benchmarks.users`): a measurement's settings (`config`), the server
side (`server`), client processes (`clients`, `petals_stream`), where CPU time goes (`cpu_share`), step timelines
(`timeline`), the report (`report`)."""

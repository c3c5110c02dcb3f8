"""The churn soak (`python -m benchmarks.soak`, `make soak`): servers killed and restarted (`chaos`) under generating
client processes (`worker`), then every generation checked and `/proc` read for leftovers (`leftovers`)."""

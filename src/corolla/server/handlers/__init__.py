"""Handler processes (`--num_handlers` N > 1): extra fronts in processes of their own, started by `handler_pool`, each
reaching the core through `remote_core`, served in the device process by `device_channel` (docs/design.md section 3)."""

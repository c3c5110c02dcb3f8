"""Turning "I host blocks i..j" into answered RPCs: the lifecycle and its wiring at the top (`config` -> `server` ->
`block_loading` + `span_service`), requests through `front/` to `core/`, handler processes in `handlers/`."""

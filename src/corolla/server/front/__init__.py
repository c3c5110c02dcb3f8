"""Fronts: where requests enter a server. Each terminates a transport, reads hostile bytes under bounds, checks who may
call, decodes each step with the one decoder and hands typed records to the core through its one seam
(docs/design.md section 3)."""

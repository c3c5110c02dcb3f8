"""The core: what a server owns once a request is valid: the seam every front talks to (`span_core`), session state and
fair use, the device thread and its scheduler (`runtime`, `gather`), the executor and training's block calls
(docs/design.md sections 3-4)."""

"""The KV store: the server-wide paged pool (`kv_pool`), waiting for its pages in arrival order (`page_queue`), the
index of published prefix pages (`prefix_index`) and one session's prefix chain over it (`session_prefix`)."""

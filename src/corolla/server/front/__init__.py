"""Fronts: where requests enter a server. Each front terminates one transport (`handler`: the seven Petals rpcs
over p2p; `local_endpoint`: the same-host socket; `direct_endpoint`: the direct port, `stream_endpoint` shared by
both, `connection_balance` spreading its connections over handler processes), reads hostile bytes under bounds
(`stream_endpoint`'s budgets and frames; `stream_guard`: p2p's streams; `handler` for gathered streams), checks who
may call (`peer_auth`), validates with the one step decoder (`block_functions`), serves each inference stream without
a task per step (`inference_stream`; on every transport the connection is a `stream_endpoint.FrameConnection`, p2p's
taken from p2pd's reader) and hands typed records to
the core through its one seam (`span_core.CoreClient`)."""

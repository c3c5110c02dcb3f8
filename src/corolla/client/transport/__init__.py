"""Ways to reach a server's inference stream: through the client's p2pd (`p2p_stream`), the same-host
unix socket (`local_transport`), the direct TCP port (`direct_transport`), all framed on one raw-socket base
(`framed_socket`); and the knock on a server's listener while its link is down (`link_probe`)."""

"""One call to one server span and its failure handling: the stateless forward/backward RPCs
(`remote_forward_backward`), what is checked in every server's outputs (`output_checks`) and the fail-over budget
of a call (`retries`)."""

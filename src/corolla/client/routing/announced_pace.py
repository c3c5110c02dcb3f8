"""What a server's record implies about its pace (`ServerInfo.inference_rps` and `forward_rps`, per block): a decode
step's time and a long step's time per token. The step deadlines (`client.session.stalls`), the delivery judge
(`client.session.delivery`) and the routes' prices (`observed_steps`) read them alike."""

from __future__ import annotations


def announced_step_s(num_blocks: int, inference_rps: float | None) -> float | None:
    """The decode step time a server's record implies for `num_blocks` of its blocks (`inference_rps` is per block:
    a token through n blocks takes n / rps); None when it announces no figure."""
    if inference_rps is None or not inference_rps > 0:
        return None
    return num_blocks / inference_rps


def announced_token_s(num_blocks: int, forward_rps: float | None, inference_rps: float | None) -> float | None:
    """The time a server's record implies for one token of a long step through `num_blocks` of its blocks: its
    prefill rate (`forward_rps`, per block, measured on a batch of tokens), else its decode rate (a prefill costs no
    more than its tokens as decode steps); None when it announces neither."""
    for rps in (forward_rps, inference_rps):
        if rps is not None and rps > 0:
            return num_blocks / rps
    return None

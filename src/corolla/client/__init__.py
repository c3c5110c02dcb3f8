"""Using remote spans as local modules. `config` (ClientConfig), `bans` + `routing` (RemoteSequenceManager; its
route math is a `corolla.swarm` policy), `inference_session` (fail-over by replay), `remote_forward_backward` +
`remote_sequential` (autograd through the swarm), `checkpoint` + `distributed_model` + `generation` (causal LMs
with generate()). All networking runs on one background asyncio loop (`background_loop`)."""

from corolla.client.config import ClientConfig
from corolla.client.distributed_model import AutoDistributedModelForCausalLM, DistributedModelForCausalLM
from corolla.client.inference_session import InferenceSession
from corolla.client.remote_sequential import RemoteSequential
from corolla.client.routing import RemoteSequenceManager

__all__ = [
    "AutoDistributedModelForCausalLM",
    "ClientConfig",
    "DistributedModelForCausalLM",
    "InferenceSession",
    "RemoteSequenceManager",
    "RemoteSequential",
]

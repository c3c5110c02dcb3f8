"""Using remote spans as local modules. `config` (ClientConfig), `bans` + `routing` (RemoteSequenceManager; its
route math is a `corolla.swarm` policy), `inference_session` (fail-over by replay), `remote_forward_backward` +
`remote_sequential` (autograd through the swarm), `checkpoint` + `distributed_model` + `generation` (causal LMs
with generate()), `prompt_tuning` + `sequence_classification` (training through the swarm: Petals' `tuning_mode`,
task heads). All networking runs on one background asyncio loop (`background_loop`)."""

from corolla.client.config import ClientConfig
from corolla.client.distributed_model import (
    AutoDistributedModelForCausalLM,
    DistributedModel,
    DistributedModelForCausalLM,
)
from corolla.client.inference_session import InferenceSession
from corolla.client.remote_sequential import RemoteSequential
from corolla.client.routing import RemoteSequenceManager
from corolla.client.sequence_classification import (
    AutoDistributedModelForSequenceClassification,
    DistributedModelForSequenceClassification,
)

__all__ = [
    "AutoDistributedModelForCausalLM",
    "AutoDistributedModelForSequenceClassification",
    "ClientConfig",
    "DistributedModel",
    "DistributedModelForCausalLM",
    "DistributedModelForSequenceClassification",
    "InferenceSession",
    "RemoteSequenceManager",
    "RemoteSequential",
]

"""Using remote spans as local modules. Folders in layers, each importing only those before it: `transport/` (the
streams to a server) and `prefix/` (prefix reuse); `routing/` (RemoteSequenceManager, bans); `calls/` (one call to
one span: forward/backward RPCs, output checks, the retry budget); `verification/`; `session/` (span sessions and
`InferenceSession`, fail-over by replay); `training/` (`RemoteSequential`, prompt tuning); `speculative/`; `models/`
(distributed models with `generate()`, sequence classification). `config` (ClientConfig) and `background_loop` (the
one asyncio loop that runs all client networking) sit beside them; the public names are re-exported here."""

from corolla.client.config import ClientConfig
from corolla.client.models.distributed_model import (
    AutoDistributedModelForCausalLM,
    DistributedModel,
    DistributedModelForCausalLM,
)
from corolla.client.models.sequence_classification import (
    AutoDistributedModelForSequenceClassification,
    DistributedModelForSequenceClassification,
)
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.session.inference_session import InferenceSession
from corolla.client.training.remote_sequential import RemoteSequential

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

"""A client whose embeddings and head live on a GPU (`model.to("cuda")`, as the two-GPU bench runs it) steps with
ids on the host: the generation loop gets each step's logits on the ids' device (it failed in torch.cat before)."""

from __future__ import annotations

import torch

from corolla.client.models.generation import GenerationLoop


class _HeadOnGpu:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.embeddings = torch.nn.Embedding(50, 16).cuda()
        self.lm_head = torch.nn.Linear(16, 50, bias=False).cuda()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings(ids.to("cuda"))  # [B, T, H] on the GPU

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [B, T, V]

    def session_step(
        self, session: _EchoSession, input_ids: torch.Tensor, prompts: object = None, *, may_reuse: bool = False
    ) -> torch.Tensor:
        # as DistributedModelForCausalLM: embed on the model's device, then one step of the session
        return session.step(self.embed(input_ids), prompts)  # [B, T, H] on the GPU


class _EchoSession:
    position = 1

    def step(self, hidden: torch.Tensor, prompts: object) -> torch.Tensor:
        return hidden.cpu().to(hidden.device)  # as InferenceSession: sent from the host, back on the input's device


def test_step_logits_come_back_on_the_ids_device():
    model = _HeadOnGpu()
    ids = torch.tensor([[3, 7, 9], [1, 2, 4]])  # [B, T] on the host
    loop = GenerationLoop(model)  # type: ignore[arg-type]
    logits = loop._step([(torch.arange(2), 0, _EchoSession())], ids, True, None)  # type: ignore[list-item]
    assert logits.device == ids.device and logits.dtype == torch.float32 and logits.shape == (2, 50)
    expected = model.head(model.embed(ids))[:, -1].float().cpu()
    torch.testing.assert_close(logits, expected)
    torch.cat([ids, logits.argmax(-1)[:, None]], dim=1)  # what the loop does next with the chosen tokens

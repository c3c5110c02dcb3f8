"""Training through the swarm, client side, against in-process fake servers (no network): Petals' `tuning_mode`
("ptune", "deep_ptune") and the sequence-classification head give the gradients of local autograd to the prompts and
the head only (the checkpoint's weights stay frozen), generation puts the tuned prefix first in a session, and
`transformers.Trainer` and plain torch optimizers train it."""

from __future__ import annotations

import pytest
import torch
from tests.unit.test_client_remote_sequential import FakeForwardServer
from transformers import LlamaConfig

from corolla.client.models.distributed_model import LAYOUTS, DistributedModelForCausalLM
from corolla.client.models.sequence_classification import DistributedModelForSequenceClassification
from corolla.client.training.prompt_tuning import TuningConfig
from helpers.fake_chain import HIDDEN, FakeManager, FakeServer, reference

NUM_BLOCKS, VOCAB, PAD_ID = 4, 24, 0


class FakeTrainingServer(FakeServer):
    """A fake server of blocks [start, end) answering rpc_inference, rpc_forward and rpc_backward."""

    def __init__(self, start: int, end: int):
        super().__init__(start, end)
        self.stateless = FakeForwardServer(start, end)

    async def rpc_forward(self, request, timeout=None):
        return await self.stateless.rpc_forward(request, timeout)

    async def rpc_backward(self, request, timeout=None):
        return await self.stateless.rpc_backward(request, timeout)


def _config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=16, num_hidden_layers=NUM_BLOCKS,
        num_attention_heads=2, num_key_value_heads=1, pad_token_id=PAD_ID, rms_norm_eps=1e-5,
    )  # fmt: skip


def _manager() -> FakeManager:
    return FakeManager({"A": FakeTrainingServer(0, 2), "B": FakeTrainingServer(2, 4)}, NUM_BLOCKS)


def _model(cls=DistributedModelForCausalLM, tuning_mode=None, pre_seq_len=0, **kwargs):
    torch.manual_seed(0)
    model = cls(_config(), LAYOUTS["llama"], _manager(), TuningConfig(tuning_mode, pre_seq_len), **kwargs)
    with torch.no_grad():  # the checkpoint's weights, random here
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


def _local_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    """What the model computes, by local autograd over the same toy blocks: final-normed [B, T, H]."""
    prefix, deep = model.tuned_prompts(ids.shape[0])
    hidden = reference(model.embed(ids, prefix), NUM_BLOCKS, deep)
    return model.final_norm(hidden[:, model.pre_seq_len :])


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tuning_mode", ["ptune", "deep_ptune"])
def test_prompt_gradients_equal_local_autograd_and_reach_only_the_prompts(tuning_mode):
    model = _model(tuning_mode=tuning_mode, pre_seq_len=3).train()
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    expected = {"prompt_tuning.prompt_embeddings.weight"}
    if tuning_mode == "deep_ptune":
        expected.add("prompt_tuning.intermediate_prompt_embeddings.weight")
        with torch.no_grad():  # zeros at first (Petals): give them values so that their gradients are exercised
            model.prompt_tuning.intermediate_prompt_embeddings.weight.normal_(0, 0.3)
    assert trainable == expected

    ids = torch.randint(1, VOCAB, (2, 5))
    out = model(ids, labels=ids)
    assert out.logits.shape == (2, 5, VOCAB)
    out.loss.backward()
    remote = _grads(model)
    assert set(remote) == expected
    model.zero_grad()

    logits = model.lm_head(_local_hidden(model, ids))
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.logits, logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.loss, loss, atol=1e-6, rtol=0)
    loss.backward()
    for name, grad in _grads(model).items():
        torch.testing.assert_close(remote[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_sequence_classification_pools_the_last_token_and_trains_head_and_prompts():
    model = _model(DistributedModelForSequenceClassification, "deep_ptune", 2, num_labels=3).train()
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        "prompt_tuning.prompt_embeddings.weight",
        "prompt_tuning.intermediate_prompt_embeddings.weight",
        "score.weight",
    }
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, PAD_ID, PAD_ID]])  # right padding, as tokenizers pad by default
    mask = (ids != PAD_ID).long()
    labels = torch.tensor([2, 0])
    out = model(ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    remote = _grads(model)
    model.zero_grad()

    rows = [model.score(_local_hidden(model, ids[i : i + 1, : int(mask[i].sum())]))[0, -1] for i in range(2)]
    pooled = torch.stack(rows)  # [B, labels] at each row's last real token
    torch.testing.assert_close(out.logits, pooled, atol=1e-5, rtol=0)
    torch.nn.functional.cross_entropy(pooled, labels).backward()
    assert set(remote) == set(_grads(model)) == {n for n, p in model.named_parameters() if p.requires_grad}
    for name, grad in _grads(model).items():
        torch.testing.assert_close(remote[name], grad, atol=1e-6, rtol=1e-4, msg=name)

    left = torch.tensor([[5, 6, 7, 8], [PAD_ID, PAD_ID, 9, 10]])  # left padding: the padded row runs alone
    with torch.no_grad():
        logits = model(left, attention_mask=(left != PAD_ID).long()).logits
    torch.testing.assert_close(logits, pooled.detach(), atol=1e-5, rtol=0)


def test_generate_puts_the_tuned_prefix_first_in_the_session():
    model = _model(tuning_mode="deep_ptune", pre_seq_len=2)
    with torch.no_grad():
        model.prompt_tuning.intermediate_prompt_embeddings.weight.normal_(0, 0.3)
    ids = torch.tensor([[3, 4, 5]])
    out = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=None)
    seq = ids
    with torch.no_grad():
        for _ in range(4):  # no cache: the whole text with the prefix each time
            seq = torch.cat([seq, model.lm_head(_local_hidden(model, seq))[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert out.tolist() == seq.tolist()
    server = model.manager.servers["A"]
    assert server.first_requests[-1]["max_length"] == 2 + 3 + 4  # the prefix's positions too
    with pytest.raises(ValueError, match="speculative"):
        from corolla.client.speculative.acceptance import SpeculativeConfig

        model.generate(ids, max_new_tokens=2, speculative=SpeculativeConfig())
    with pytest.raises(ValueError, match="deep_ptune"):
        model(ids, prompts=torch.zeros(NUM_BLOCKS, 1, 1, HIDDEN))


def test_tuning_config_is_validated():
    with pytest.raises(ValueError, match="pre_seq_len"):
        TuningConfig("ptune", 0)
    with pytest.raises(ValueError, match="tuning_mode"):
        TuningConfig("lora", 4)
    with pytest.raises(ValueError, match="needs tuning_mode"):
        TuningConfig(None, 4)


def test_prompts_stay_float32_when_the_model_is_cast():
    model = _model(tuning_mode="ptune", pre_seq_len=2).to(torch.bfloat16)
    assert model.embeddings.weight.dtype == torch.bfloat16
    assert model.prompt_tuning.prompt_embeddings.weight.dtype == torch.float32
    prefix, _ = model.tuned_prompts(1)
    assert prefix.dtype == torch.bfloat16


def test_trainer_and_a_torch_optimizer_lower_the_loss():
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    class Rows(Dataset):
        def __init__(self, n: int):
            g = torch.Generator().manual_seed(1)
            self.ids = torch.randint(1, VOCAB, (n, 4), generator=g)
            self.labels = (self.ids[:, 0] > VOCAB // 2).long()  # learnable from the first token

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[i], "labels": self.labels[i]}

    data = Rows(16)
    model = _model(DistributedModelForSequenceClassification, "ptune", 2, num_labels=2)
    with torch.no_grad():
        before = model(data.ids, labels=data.labels).loss.item()
    args = TrainingArguments(
        output_dir="/nonexistent-unused", per_device_train_batch_size=8, num_train_epochs=10, learning_rate=0.05,
        save_strategy="no", report_to=[], use_cpu=True, logging_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    Trainer(model=model, args=args, train_dataset=data).train()
    with torch.no_grad():
        after = model(data.ids, labels=data.labels).loss.item()
    assert after < 0.7 * before

    model = _model(DistributedModelForSequenceClassification, "ptune", 2, num_labels=2).train()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
    for _ in range(20):
        optimizer.zero_grad()
        model(data.ids, labels=data.labels).loss.backward()
        optimizer.step()
    with torch.no_grad():
        assert model(data.ids, labels=data.labels).loss.item() < 0.7 * before


def test_peft_lora_on_the_client_head_trains_with_the_prompts():
    """A client-side LoRA (PEFT's `inject_adapter_in_model` on the LM head) trains beside the prompts: the gradients
    reach the prompts and the adapter only and equal local autograd."""
    from peft import LoraConfig, inject_adapter_in_model

    model = _model(tuning_mode="ptune", pre_seq_len=2)
    model = inject_adapter_in_model(LoraConfig(r=2, lora_alpha=4, target_modules=["lm_head"]), model)
    model.prompt_tuning.requires_grad_(True)  # PEFT freezes everything but its adapters
    with torch.no_grad():
        model.lm_head.lora_B["default"].weight.normal_(0, 0.3)  # PEFT starts B at zero: exercise both factors
    model.train()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {
        "prompt_tuning.prompt_embeddings.weight",
        "lm_head.lora_A.default.weight",
        "lm_head.lora_B.default.weight",
    }
    ids = torch.randint(1, VOCAB, (2, 5))
    model(ids, labels=ids).loss.backward()
    remote = _grads(model)
    assert set(remote) == trainable
    model.zero_grad()
    logits = model.lm_head(_local_hidden(model, ids))
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
    for name, grad in _grads(model).items():
        torch.testing.assert_close(remote[name], grad, atol=1e-6, rtol=1e-4, msg=name)

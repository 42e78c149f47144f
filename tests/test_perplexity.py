"""Perplexity protocol (hf_maskllm.perplexity) checked against a hand computation."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_maskllm.errors import DataError
from hf_maskllm.perplexity import evaluate_perplexity


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger logits than the 0.02 init, so the PPL is far from the uniform 128
        model.lm_head.weight.mul_(30)
    return model


class CharTokenizer:
    def __call__(self, text, return_tensors=None, verbose=True):
        ids = [min(ord(c), 127) for c in text]
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}


class Wrapper(torch.nn.Module):
    """Not a PreTrainedModel: forward(input_ids) returns an object with .logits."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def forward(self, input_ids):
        return self.inner(input_ids=input_ids)


def hand_perplexity(model, windows: torch.Tensor) -> float:
    nll, count = 0.0, 0
    with torch.no_grad():
        for row in windows:
            logp = torch.log_softmax(model(row[None]).logits[0].double(), dim=-1)
            for t in range(row.numel() - 1):
                nll -= logp[t, row[t + 1]].item()
                count += 1
    return math.exp(nll / count)


def test_matches_hand_computation_and_is_batch_invariant():
    model = tiny_llama().eval()
    windows = torch.randint(0, 128, (5, 17), generator=torch.Generator().manual_seed(1))
    expected = hand_perplexity(model, windows)
    assert not math.isclose(expected, 128.0, rel_tol=0.05)
    got = [evaluate_perplexity(model, None, windows, batch_size=b, progress=False) for b in (1, 3, 5)]
    for value in got:
        assert value == pytest.approx(expected, rel=1e-5)
    assert evaluate_perplexity(model, None, windows, max_windows=2, progress=False) == pytest.approx(
        hand_perplexity(model, windows[:2]), rel=1e-5
    )


def test_texts_use_window_protocol_and_restore_training_mode():
    model = tiny_llama()
    model.train()
    model.model.layers[0].eval()  # mixed modes must come back exactly
    texts = ["The quick brown fox", "jumps over the lazy dog."]  # 19 + 2 + 24 = 45 chars -> 4 windows of 10
    joined = "\n\n".join(texts)
    windows = torch.tensor([ord(c) for c in joined[:40]]).reshape(4, 10)
    got = evaluate_perplexity(Wrapper(model), CharTokenizer(), texts, seqlen=10, batch_size=3, progress=False)
    assert got == pytest.approx(hand_perplexity(model, windows), rel=1e-5)
    assert model.training and not model.model.layers[0].training and model.model.layers[1].training


def test_bf16_model_scored_in_fp32():
    model = tiny_llama().to(torch.bfloat16)
    windows = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(2))
    got = evaluate_perplexity(model, None, windows, batch_size=2, progress=False)
    assert got == pytest.approx(hand_perplexity(model, windows), rel=1e-5)  # same bf16 logits, fp32 reduction


def test_errors():
    model = tiny_llama()
    with pytest.raises(DataError, match="fewer than one window"):
        evaluate_perplexity(model, CharTokenizer(), ["short"], seqlen=64, progress=False)
    with pytest.raises(DataError, match="integer tensor"):
        evaluate_perplexity(model, None, torch.zeros(3, 8), progress=False)
    with pytest.raises(DataError, match="W = 0"):
        evaluate_perplexity(model, None, torch.zeros(0, 8, dtype=torch.long), progress=False)
    with pytest.raises(DataError, match="batch_size"):
        evaluate_perplexity(model, None, torch.zeros(1, 8, dtype=torch.long), batch_size=0, progress=False)

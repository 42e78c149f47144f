"""Tiny seeded models shared by the adapter tests (a plain module: ``from models import ...``).

Every factory builds a randomly initialised model from a small config (hidden 64, 2 layers, vocab
128) under a fixed seed, so two calls return identical weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertModel,
    GemmaConfig,
    GemmaForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 128


@pytest.fixture(autouse=True, scope="module")
def single_thread() -> Iterator[None]:
    """Run tiny models on one thread: on a busy 2-core machine, two OpenMP threads can be 100x slower.

    Import it into a test module (``from models import single_thread  # noqa: F401``) to apply it there.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


HIDDEN = 64
INTERMEDIATE = 128


def _seeded(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return build().eval()


def _decoder_kwargs() -> dict:
    return {
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 128,
    }


def tiny_llama(seed: int = 0, hidden: int = HIDDEN, intermediate: int = INTERMEDIATE) -> LlamaForCausalLM:
    """Llama (SmolLM2's architecture), untied embeddings."""
    kwargs = {**_decoder_kwargs(), "hidden_size": hidden, "intermediate_size": intermediate}
    return _seeded(lambda: LlamaForCausalLM(LlamaConfig(**kwargs)), seed)


def tiny_llama_tied(seed: int = 0) -> LlamaForCausalLM:
    """Llama with tied input / output embeddings, like SmolLM2."""
    return _seeded(lambda: LlamaForCausalLM(LlamaConfig(**_decoder_kwargs(), tie_word_embeddings=True)), seed)


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    return _seeded(lambda: Qwen2ForCausalLM(Qwen2Config(**_decoder_kwargs())), seed)


def tiny_mistral(seed: int = 0) -> MistralForCausalLM:
    return _seeded(lambda: MistralForCausalLM(MistralConfig(**_decoder_kwargs(), sliding_window=None)), seed)


def tiny_gemma(seed: int = 0) -> GemmaForCausalLM:
    return _seeded(lambda: GemmaForCausalLM(GemmaConfig(**_decoder_kwargs(), head_dim=16)), seed)


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    """GPT-2: its linears are transformers ``Conv1D`` (weight stored ``[in, out]``)."""
    cfg = GPT2Config(
        n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=128, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0
    )
    return _seeded(lambda: GPT2LMHeadModel(cfg), seed)


def tiny_opt(seed: int = 0) -> OPTForCausalLM:
    cfg = OPTConfig(
        hidden_size=HIDDEN,
        ffn_dim=INTERMEDIATE,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=VOCAB,
        word_embed_proj_dim=HIDDEN,
        max_position_embeddings=128,
    )
    return _seeded(lambda: OPTForCausalLM(cfg), seed)


def _bert_config() -> BertConfig:
    return BertConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=128,
    )


def tiny_bert_mlm(seed: int = 0) -> BertForMaskedLM:
    return _seeded(lambda: BertForMaskedLM(_bert_config()), seed)


def tiny_bert(seed: int = 0) -> BertModel:
    """A bare encoder (no output embedding, has a pooler)."""
    return _seeded(lambda: BertModel(_bert_config()), seed)


class OddNet(nn.Module):
    """Two maskable layers and one whose input size (6) is not divisible by 4 or 8."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 6)
        self.odd = nn.Linear(6, 8)
        self.down = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.odd(torch.relu(self.up(x)))))


def odd_net(seed: int = 0) -> OddNet:
    return _seeded(OddNet, seed)


FACTORIES: dict[str, Callable[..., nn.Module]] = {
    "llama": tiny_llama,
    "llama_tied": tiny_llama_tied,
    "qwen2": tiny_qwen2,
    "mistral": tiny_mistral,
    "gemma": tiny_gemma,
    "gpt2": tiny_gpt2,
    "opt": tiny_opt,
    "bert_mlm": tiny_bert_mlm,
    "bert": tiny_bert,
}


def model_inputs(model: nn.Module, batch: int = 2, seq: int = 8, seed: int = 1) -> dict[str, torch.Tensor]:
    """Seeded ``input_ids`` (and an attention mask) for any of the factories' models."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, seq), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def output_tensor(outputs) -> torch.Tensor:
    """The main output of a transformers model: ``logits`` or ``last_hidden_state``."""
    logits = getattr(outputs, "logits", None)
    return logits if logits is not None else outputs.last_hidden_state

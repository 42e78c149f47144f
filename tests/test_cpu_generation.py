"""Greedy generation of the compressed SmolLM2-135M on the CPU kernels equals the dense-with-zeros model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_maskllm import MaskConfig, get_mask_model
from hf_maskllm.embedded import load_smollm2
from hf_maskllm.kernels.cpu_extension import cpu_kernels
from hf_maskllm.sparse import SparseLinear

PROMPT = "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg"


@pytest.mark.slow
@pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels could not be built here")
def test_compressed_smollm2_generates_the_dense_tokens(tmp_path):
    torch.manual_seed(0)
    model, tokenizer = load_smollm2(dtype=torch.float32)
    mask_model = get_mask_model(model, MaskConfig(n=2, m=4, prior="magnitude"))
    mask_model.save_pretrained(tmp_path, merged=True)
    dense = mask_model.merge_and_unload().eval()  # the same weights with zeros, plain nn.Linear
    sparse = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    layers = [mod for mod in sparse.modules() if isinstance(mod, SparseLinear)]
    assert len(layers) == 210
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    kwargs = {"max_new_tokens": 32, "min_new_tokens": 32, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        expected = dense.generate(ids, **kwargs)
        got = sparse.generate(ids, **kwargs)
    assert got.shape[1] == ids.shape[1] + 32
    assert torch.equal(got, expected), (tokenizer.decode(got[0]), tokenizer.decode(expected[0]))
    assert all(layer._cache is None for layer in layers)  # no dense copy was built or kept

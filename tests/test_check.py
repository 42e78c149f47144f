"""check_nm: every masked layer of a merged (or loaded compressed) model keeps at most n of each m weights."""

from __future__ import annotations

import pytest
import torch
from models import single_thread, tiny_llama  # noqa: F401  (autouse fixture)

from hf_maskllm import MaskConfig, MaskModel, check_nm, get_mask_model
from hf_maskllm.errors import MaskLLMError, NMViolationError


def _trained_like() -> MaskModel:
    """A 2:4 mask model whose masks are far from the init, as after training."""
    mm = get_mask_model(tiny_llama(), MaskConfig())
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in mm.masked_layers().values():
            layer.mask_logits.copy_(torch.randn(layer.mask_logits.shape, generator=generator))
    return mm.eval()


def test_check_nm_reports_planted_violations():
    mm = _trained_like()
    merged = mm.merge_and_unload()
    q = merged.model.layers[0].self_attn.q_proj.weight
    down = merged.model.layers[1].mlp.down_proj.weight
    with torch.no_grad():
        for group in (0, 5, 9):  # 3 groups of q_proj's row 0 get all 4 weights nonzero
            q[0, 4 * group : 4 * group + 4] = 0.5
        down[3, 8:12] = torch.tensor([1.0, 1.0, 1.0, 0.0])  # 3 of 4 in one group
    report = check_nm(merged, 2, 4, raise_on_violation=False)
    assert report.violations == {"model.layers.0.self_attn.q_proj": 3, "model.layers.1.mlp.down_proj": 1}
    assert not report.ok and "4 violating groups" in str(report)
    with pytest.raises(NMViolationError, match="q_proj"):
        check_nm(merged, 2, 4)
    # 3:4 allows the 3-of-4 group but not the full ones
    assert check_nm(merged, 3, 4, raise_on_violation=False).violations == {
        "model.layers.0.self_attn.q_proj": 3
    }
    # excluding the broken layers makes it pass
    assert check_nm(merged, 2, 4, exclude_modules=["layers.0.self_attn.q_proj", "layers.1.mlp.down_proj"]).ok


def test_check_nm_on_dense_and_unmerged_models():
    dense = tiny_llama()
    report = check_nm(dense, 2, 4, raise_on_violation=False)
    assert len(report.layers) == 14 and all(bad == groups for groups, bad in report.layers.values())
    mm = get_mask_model(tiny_llama(), MaskConfig())
    with pytest.raises(MaskLLMError, match="merge_and_unload"):
        check_nm(mm, 2, 4)

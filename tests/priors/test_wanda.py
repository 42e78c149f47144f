"""Wanda N:M masks: |w| times the input's norm, by hand (the calibration driver: test_calibration.py)."""

from __future__ import annotations

import torch

from hf_maskllm.priors import magnitude_mask, wanda_mask


def test_wanda_hand_example_differs_from_magnitude():
    w = torch.tensor([[1.0, 2.0, 3.0, 4.0, -1.0, 0.5, 0.2, -0.3]])
    norms = torch.tensor([10.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 20.0])
    # Scores: [10, 2, 3, 4 | 1, 0.5, 0.2, 6] -> keep {0, 3} and {4, 7}; magnitude keeps {2, 3} and {4, 5}.
    assert torch.equal(wanda_mask(w, norms, 2, 4), torch.tensor([[1, 0, 0, 1, 1, 0, 0, 1]], dtype=torch.bool))
    assert torch.equal(magnitude_mask(w, 2, 4), torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0]], dtype=torch.bool))

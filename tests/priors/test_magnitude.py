"""Magnitude N:M masks: the largest |w| of each group of m, by hand."""

from __future__ import annotations

import torch

from hf_maskllm.priors import magnitude_mask


def test_magnitude_hand_example_2_4():
    w = torch.tensor(
        [
            [0.1, -0.9, 0.5, 0.2, 3.0, -4.0, 1.0, 0.0],
            [-2.0, 1.0, 0.3, -0.4, 0.5, 0.6, -0.7, 0.05],
        ]
    )
    expected = torch.tensor(
        [
            [0, 1, 1, 0, 1, 1, 0, 0],
            [1, 1, 0, 0, 0, 1, 1, 0],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(magnitude_mask(w, 2, 4), expected)
    # 1:4 keeps the single largest |w| per group.
    expected_1_4 = torch.tensor([[0, 1, 0, 0, 0, 1, 0, 0], [1, 0, 0, 0, 0, 0, 1, 0]], dtype=torch.bool)
    assert torch.equal(magnitude_mask(w, 1, 4), expected_1_4)
    # Ties go to the lower index, deterministically.
    assert torch.equal(magnitude_mask(torch.ones(1, 4), 2, 4), torch.tensor([[1, 1, 0, 0]], dtype=torch.bool))

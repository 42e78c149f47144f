"""One-shot N:M pruning methods: MaskLLM priors and the baselines it is compared with.

- :func:`compute_prior_masks`: magnitude, Wanda or SparseGPT masks; the model is left unchanged.
- :func:`sparsegpt_prune`: the SparseGPT baseline, weights updated in place.
- :func:`sparsegpt_reconstruct`: SparseGPT's weight update for given masks (no mask choice), in place.
"""

from .calibration import (
    PRIOR_METHODS,
    compute_prior_masks,
    find_decoder_blocks,
    sparsegpt_prune,
    sparsegpt_reconstruct,
)
from .magnitude import magnitude_mask, nm_mask_from_scores
from .sparsegpt import HessianStats, sparsegpt_layer
from .wanda import InputNormStats, wanda_mask

__all__ = [
    "PRIOR_METHODS",
    "HessianStats",
    "InputNormStats",
    "compute_prior_masks",
    "find_decoder_blocks",
    "magnitude_mask",
    "nm_mask_from_scores",
    "sparsegpt_layer",
    "sparsegpt_prune",
    "sparsegpt_reconstruct",
    "wanda_mask",
]

"""``MaskedLinear``: a Linear (or GPT-2 Conv1D) whose weight is multiplied by a learnable N:M mask."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..modules import dense_weight_view
from ..patterns import candidate_patterns
from .denormals import masked_weight_product
from .fused_linear import candidate_major, masked_linear
from .sampling import draw_seed, hard_indices, sample_soft_mask

__all__ = ["MaskedLinear"]


class MaskedLinear(nn.Module):
    """Wraps a frozen ``nn.Linear`` / ``Conv1D`` and masks its weight with learnable N:M logits.

    ``mask_logits`` has shape ``[out * in / m, C(m, n)]``. Forward, in this order:
    masking disabled -> plain base layer; training -> a soft Gumbel sample (new every call);
    evaluation -> the hard argmax mask, cached until the logits change.
    """

    def __init__(self, base_layer: nn.Module, n: int, m: int, logits: torch.Tensor) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.n, self.m = n, m
        weight = dense_weight_view(base_layer)
        self.out_features, self.in_features = weight.shape
        groups = self.out_features * self.in_features // m
        if tuple(logits.shape) != (groups, candidate_patterns(n, m).shape[0]):
            raise ConfigError(
                f"logits must have shape {(groups, candidate_patterns(n, m).shape[0])}, got {tuple(logits.shape)}."
            )
        base_layer.weight.requires_grad_(False)
        if getattr(base_layer, "bias", None) is not None:
            base_layer.bias.requires_grad_(False)
        self.mask_logits = nn.Parameter(logits.to(weight.device))
        self.register_buffer("candidates", candidate_patterns(n, m, device=weight.device), persistent=False)
        # Set by MaskAnnealCallback (or by hand); plain floats, not state.
        self.tau = 4.0
        self.kappa = 100.0
        self.hard = False
        self.masking_enabled = True
        self.track_sparse_reg = False
        self.compiled_sampling = False  # run the fused sampling passes through torch.compile
        self.recompute_sampling: bool | None = None  # None: keep the sample's probabilities on CPU only
        self.candidate_major_logits = False  # how mask_logits is stored (set_logits_layout)
        self.last_sparse_reg: torch.Tensor | None = None
        self._cache_key: tuple | None = None
        self._cached_mask: torch.Tensor | None = None

    # ------------------------------------------------------------------ masks
    def hard_mask(self) -> torch.Tensor:
        """The exact N:M bool mask ``[out, in]`` of the current logits.

        Cached in eval mode only, keyed on the logits' storage and version counter and dropped on
        every ``train()`` / ``eval()`` switch: optimizers update parameters with foreach kernels
        that do not bump the version counter, so in training mode it is always recomputed.
        """
        key = (self.mask_logits.data_ptr(), self.mask_logits._version, self.mask_logits.device)
        if self.training or self._cache_key != key or self._cached_mask is None:
            idx = hard_indices(self.mask_logits.detach()).long()
            mask = self.candidates.bool()[idx].reshape(self.out_features, self.in_features)
            if self.training:
                return mask
            self._cached_mask, self._cache_key = mask, key
        return self._cached_mask

    @torch.no_grad()
    def set_logits_layout(self, candidate_major_storage: bool) -> None:
        """Store ``mask_logits`` candidate-major (``[C, G]`` storage, contiguous columns for the fused
        passes) or row-major; same values and parameter object. A sharded (DTensor) parameter is left as is."""
        self.candidate_major_logits = bool(candidate_major_storage)
        logits = self.mask_logits
        if type(logits.data) is not torch.Tensor:
            return
        logits.data = candidate_major(logits.data) if candidate_major_storage else logits.data.contiguous()

    def train(self, mode: bool = True) -> MaskedLinear:
        self._cached_mask, self._cache_key = None, None
        return super().train(mode)

    def sample_mask(self) -> torch.Tensor:
        """A differentiable soft (or straight-through) mask ``[out, in]`` sampled at the current tau, kappa."""
        soft = sample_soft_mask(self.mask_logits, self.candidates, self.tau, self.kappa, self.hard)
        return soft.reshape(self.out_features, self.in_features)

    def masked_weight(self) -> torch.Tensor:
        """The effective ``[out, in]`` weight in the current mode (training: a fresh soft sample by plain
        autograd; the training forward computes the same thing fused, ``fused_linear.py``). Values
        below the float32 normal range are zeros (``denormals.py``)."""
        weight = dense_weight_view(self.base_layer)
        if self.training:
            return masked_weight_product(weight, self.sample_mask().to(weight.dtype))
        return weight * self.hard_mask().to(weight.dtype)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.masking_enabled:
            return self.base_layer(x)
        bias = getattr(self.base_layer, "bias", None)
        weight = dense_weight_view(self.base_layer)
        if not self.training:
            return F.linear(x, self.masked_weight(), bias)
        if weight.requires_grad or (bias is not None and bias.requires_grad):
            # Someone unfroze the base layer: plain autograd also gives its gradients.
            masked = self.masked_weight()
            if self.track_sparse_reg:
                self.last_sparse_reg = masked.float().square().sum()
            return F.linear(x, masked, bias)
        # The fused path: at most the sample's probabilities kept for the backward pass (fused_linear.py).
        y, reg = masked_linear(
            x, weight, bias, self.mask_logits, self.n, self.m, draw_seed(weight.device),
            self.tau, self.kappa, self.hard, self.track_sparse_reg, self.compiled_sampling,
            self.recompute_sampling,
        )  # fmt: skip
        if self.track_sparse_reg:
            # ||W * mask||^2 with W frozen: the gradient reaches only the logits.
            self.last_sparse_reg = reg
        return y

    # ------------------------------------------------------------------ merge
    @torch.no_grad()
    def merge(self) -> nn.Module:
        """Return the base layer with ``W * hard_mask`` written into its weight (wrapper no longer needed)."""
        mask = self.hard_mask()
        weight = dense_weight_view(self.base_layer)
        weight.mul_(mask.to(weight.dtype))
        return self.base_layer

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, n={self.n}, m={self.m}, "
            f"logits={tuple(self.mask_logits.shape)}"
        )

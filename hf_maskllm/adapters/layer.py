"""``MaskedLinear``: a Linear (or GPT-2 Conv1D) whose weight is multiplied by a learnable N:M mask.

The layer owns every named mask over its weight the way PEFT's layers own their adapters: the logits
of each mask are a parameter of the layer under the mask's name (``logits.<name>``), a mask held as a
packed hard mask is a buffer (``packed_masks.<name>``), and one of them is active. ``.to()``,
``state_dict``, DDP and FSDP see them as they see any parameter or buffer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, MaskLLMError
from ..modules import dense_weight_view
from ..numerics.denormals import masked_weight_product
from ..numerics.fused_linear import candidate_major, masked_linear
from ..numerics.sampling import draw_seed, hard_indices, sample_soft_mask
from ..patterns import candidate_patterns, num_candidates
from .packing import unpack_indices
from .schedule import MaskSchedule

__all__ = ["MaskedLinear", "collect_regulariser", "mask_key"]

# The regulariser terms of the forward pass in progress (see collect_regulariser).
_REGULARISER: ContextVar[list[torch.Tensor] | None] = ContextVar("hf_maskllm_regulariser", default=None)


@contextlib.contextmanager
def collect_regulariser() -> Iterator[list[torch.Tensor]]:
    """Within this context, every masked layer that computes the sparse weight regulariser
    ``||W * mask||^2`` in its training forward appends it to the yielded list."""
    terms: list[torch.Tensor] = []
    token = _REGULARISER.set(terms)
    try:
        yield terms
    finally:
        _REGULARISER.reset(token)


def mask_key(mask_name: str) -> str:
    """The key a mask is stored under in a layer (module keys cannot hold the ``.`` a mask name may)."""
    return mask_name.replace(".", ":")


class _Buffers(nn.Module):
    """A dict of buffers, by key (what ``nn.ParameterDict`` is for parameters)."""

    def __contains__(self, key: str) -> bool:
        return key in self._buffers

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._buffers[key]

    def __setitem__(self, key: str, tensor: torch.Tensor) -> None:
        self.register_buffer(key, tensor)

    def __delitem__(self, key: str) -> None:
        del self._buffers[key]


class MaskedLinear(nn.Module):
    """Wraps a frozen ``nn.Linear`` / ``Conv1D`` and masks its weight with learnable N:M logits.

    Each mask's logits have shape ``[out * in / m, C(m, n)]``. Forward, in this order: masks disabled
    (the schedule's ``masks_disabled``) -> the base layer alone; training -> a soft Gumbel sample of the
    active mask (new every call) at the schedule's tau and kappa; evaluation -> the active mask's hard
    argmax mask, cached until the logits change.

    Args:
        base_layer: The ``nn.Linear`` or ``Conv1D`` to mask; its weight and bias are frozen.
        n, m: Keep ``n`` of every ``m`` consecutive inputs.
        logits: The first mask's logits (optional); it becomes active and trainable.
        mask_name: That mask's name.
        schedule: The :class:`MaskSchedule` to read (a ``MaskModel`` passes its own; default: a new one).
    """

    def __init__(
        self,
        base_layer: nn.Module,
        n: int,
        m: int,
        logits: torch.Tensor | None = None,
        mask_name: str = "default",
        schedule: MaskSchedule | None = None,
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.n, self.m = n, m
        weight = dense_weight_view(base_layer)
        self.out_features, self.in_features = weight.shape
        base_layer.weight.requires_grad_(False)
        if getattr(base_layer, "bias", None) is not None:
            base_layer.bias.requires_grad_(False)
        self.logits = nn.ParameterDict()
        self.packed_masks = _Buffers()
        self.register_buffer("candidates", candidate_patterns(n, m, device=weight.device), persistent=False)
        self.schedule = MaskSchedule() if schedule is None else schedule
        self._names: list[str] = []  # every mask, in the order added
        self._active: str | None = None
        self._candidate_major = False  # how the active logits are stored (set_logits_layout)
        self._cache_key: tuple | None = None
        self._cached_mask: torch.Tensor | None = None
        self.register_load_state_dict_pre_hook(_accept_unnamed_logits)
        if logits is not None:
            self.add_mask(mask_name, logits=logits)
            self.set_mask(mask_name, trainable=True)

    # ------------------------------------------------------------------ named masks
    @property
    def num_groups(self) -> int:
        """Groups of ``m`` weights: the rows of each mask's logits."""
        return self.out_features * self.in_features // self.m

    @property
    def mask_names(self) -> list[str]:
        """Every mask of this layer, in the order added."""
        return list(self._names)

    @property
    def active_mask(self) -> str | None:
        """The mask the forward uses."""
        return self._active

    @property
    def mask_logits(self) -> nn.Parameter:
        """The active mask's logits ``[G, C]``."""
        if self._active is None:
            raise MaskLLMError("This MaskedLinear holds no active mask; add one with add_mask and set_mask.")
        return self.logits[mask_key(self._active)]

    def has_logits(self, mask_name: str) -> bool:
        """Whether ``mask_name`` is held as logits (rather than only as a packed hard mask)."""
        return mask_key(mask_name) in self.logits

    def get_logits(self, mask_name: str) -> nn.Parameter:
        """The logits of ``mask_name`` (which must be held as logits)."""
        self._check_known(mask_name)
        return self.logits[mask_key(mask_name)]

    def get_packed(self, mask_name: str) -> torch.Tensor | None:
        """The packed hard mask of ``mask_name`` (uint8 candidate indices), or ``None`` when it has none."""
        self._check_known(mask_name)
        key = mask_key(mask_name)
        return self.packed_masks[key] if key in self.packed_masks else None

    def add_mask(
        self, mask_name: str, logits: torch.Tensor | None = None, packed: torch.Tensor | None = None
    ) -> None:
        """Hold a new, inactive mask: its logits ``[G, C]`` (a frozen parameter), its packed hard mask
        (a buffer), or both. Tensors move to the base weight's device."""
        if mask_name in self._names:
            raise MaskLLMError(f"This layer holds a mask named {mask_name!r} already.")
        if logits is None and packed is None:
            raise MaskLLMError(f"Mask {mask_name!r}: give its logits, its packed hard mask, or both.")
        device = dense_weight_view(self.base_layer).device
        if logits is not None:
            expected = (self.num_groups, num_candidates(self.n, self.m))
            if tuple(logits.shape) != expected:
                raise ConfigError(f"logits must have shape {expected}, got {tuple(logits.shape)}.")
            self.logits[mask_key(mask_name)] = nn.Parameter(logits.detach().to(device), requires_grad=False)
        if packed is not None:
            self.packed_masks[mask_key(mask_name)] = packed.to(device)
        self._names.append(mask_name)

    def set_mask(self, mask_name: str, trainable: bool, logits_dtype: torch.dtype | None = None) -> None:
        """Make ``mask_name`` the active mask, trainable or not. A mask held only packed is decoded into
        one-hot logits of ``logits_dtype`` (default: the previously active logits' dtype) first."""
        self._check_known(mask_name)
        previous = self._active
        if previous is not None and previous != mask_name:
            self.mask_logits.requires_grad_(False)
        key = mask_key(mask_name)
        if key not in self.logits:
            dtype = logits_dtype or (self.mask_logits.dtype if previous is not None else torch.float32)
            c = num_candidates(self.n, self.m)
            idx = unpack_indices(self.packed_masks[key], self.num_groups, c)
            one_hot = torch.zeros(self.num_groups, c, dtype=dtype, device=self.packed_masks[key].device)
            one_hot.scatter_(1, idx.to(one_hot.device, torch.int64)[:, None], 1.0)
            self.logits[key] = nn.Parameter(one_hot, requires_grad=False)
        self._active = mask_name
        self.set_logits_layout(self._candidate_major)  # the layout the layer is set to, either way
        self.mask_logits.requires_grad_(bool(trainable))
        self._drop_cached_mask()

    def drop_logits(self, mask_name: str) -> None:
        """Free the logits of an inactive mask that has a packed hard mask (it stays, packed)."""
        self._check_known(mask_name)
        key = mask_key(mask_name)
        if mask_name == self._active or key not in self.packed_masks:
            raise MaskLLMError(f"Mask {mask_name!r} is active or has no packed hard mask; its logits stay.")
        if key in self.logits:
            del self.logits[key]

    def delete_mask(self, mask_name: str) -> None:
        """Remove an inactive mask."""
        self._check_known(mask_name)
        if mask_name == self._active:
            raise MaskLLMError(f"Mask {mask_name!r} is the active mask; activate another one first.")
        key = mask_key(mask_name)
        if key in self.logits:
            del self.logits[key]
        if key in self.packed_masks:
            del self.packed_masks[key]
        self._names.remove(mask_name)

    def _check_known(self, mask_name: str) -> None:
        if mask_name not in self._names:
            raise MaskLLMError(f"No mask named {mask_name!r} in this layer; it holds {self._names}.")

    # ------------------------------------------------------------------ hard masks
    @torch.no_grad()
    def hard_indices(self, mask_name: str | None = None) -> torch.Tensor:
        """Every group's chosen candidate (argmax of the logits, or the packed hard mask) of ``mask_name``
        (default: the active mask)."""
        name = self._active if mask_name is None else mask_name
        self._check_known(name)
        key = mask_key(name)
        if key in self.logits:
            return hard_indices(self.logits[key].detach()).long()
        return unpack_indices(self.packed_masks[key], self.num_groups, num_candidates(self.n, self.m))

    def hard_mask(self) -> torch.Tensor:
        """The exact N:M bool mask ``[out, in]`` of the active mask's logits.

        Cached in eval mode only, keyed on the logits' storage and version counter and dropped on
        every ``train()`` / ``eval()`` switch and mask switch: optimizers update parameters with foreach
        kernels that do not bump the version counter, so in training mode it is always recomputed.
        """
        logits = self.mask_logits
        key = (logits.data_ptr(), logits._version, logits.device)
        if self.training or self._cache_key != key or self._cached_mask is None:
            idx = hard_indices(logits.detach()).long()
            mask = self.candidates.bool()[idx].reshape(self.out_features, self.in_features)
            if self.training:
                return mask
            self._cached_mask, self._cache_key = mask, key
        return self._cached_mask

    def cached_bytes(self) -> int:
        """Bytes of the hard mask cached for evaluation (0 when none is cached)."""
        cached = self._cached_mask
        return 0 if cached is None else cached.numel() * cached.element_size()

    def _drop_cached_mask(self) -> None:
        self._cached_mask, self._cache_key = None, None

    @torch.no_grad()
    def set_logits_layout(self, candidate_major_storage: bool) -> None:
        """Store the active logits candidate-major (``[C, G]`` storage, contiguous columns for the fused
        passes) or row-major; same values and parameter object. A mask activated later is stored the
        same way. A sharded (DTensor) parameter is left as is."""
        self._candidate_major = bool(candidate_major_storage)
        if self._active is None:
            return
        logits = self.mask_logits
        if type(logits.data) is not torch.Tensor:
            return
        logits.data = candidate_major(logits.data) if candidate_major_storage else logits.data.contiguous()

    @property
    def candidate_major_logits(self) -> bool:
        """Whether the active logits are stored candidate-major (:meth:`set_logits_layout`)."""
        return self._candidate_major

    def train(self, mode: bool = True) -> MaskedLinear:
        self._drop_cached_mask()
        return super().train(mode)

    # ------------------------------------------------------------------ forward
    def sample_mask(self) -> torch.Tensor:
        """A differentiable soft (or straight-through) mask ``[out, in]`` sampled at the schedule's tau, kappa."""
        s = self.schedule
        soft = sample_soft_mask(self.mask_logits, self.candidates, s.tensor("tau"), s.tensor("kappa"), s.hard)
        return soft.reshape(self.out_features, self.in_features)

    def masked_weight(self) -> torch.Tensor:
        """The effective ``[out, in]`` weight in the current mode (training: a fresh soft sample by plain
        autograd; the training forward computes the same thing fused, ``numerics/fused_linear.py``).
        Values below the float32 normal range are zeros (``numerics/denormals.py``)."""
        weight = dense_weight_view(self.base_layer)
        if self.training:
            return masked_weight_product(weight, self.sample_mask().to(weight.dtype))
        return weight * self.hard_mask().to(weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.schedule.masks_disabled:  # the unmasked model's pass: the base layer alone, no mask
            return self.base_layer(x)
        bias = getattr(self.base_layer, "bias", None)
        if not self.training:
            return F.linear(x, self.masked_weight(), bias)
        s = self.schedule
        # The regulariser is computed whenever it has a weight (so an activation-checkpointing
        # recomputation runs the same computation) and handed to the forward that collects it.
        with_reg = s.regularising
        terms = _REGULARISER.get()
        weight = dense_weight_view(self.base_layer)
        if weight.requires_grad or (bias is not None and bias.requires_grad):
            # Someone unfroze the base layer: plain autograd also gives its gradients.
            masked = self.masked_weight()
            if with_reg and terms is not None:
                terms.append(masked.float().square().sum())
            return F.linear(x, masked, bias)
        # The fused path: at most the sample's probabilities kept for the backward pass (fused_linear.py).
        y, reg = masked_linear(
            x, weight, bias, self.mask_logits, self.n, self.m, draw_seed(weight.device),
            s.tensor("tau"), s.tensor("kappa"), s.hard, with_reg, s.compiled_sampling, s.recompute_sampling,
        )  # fmt: skip
        if with_reg and terms is not None:
            terms.append(reg)  # ||W * mask||^2 with W frozen: the gradient reaches only the logits
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
            f"masks={self._names}, active={self._active!r}"
        )


def _accept_unnamed_logits(module: MaskedLinear, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load a state dict keyed ``<layer>.mask_logits`` (one unnamed mask) into the active mask."""
    old = prefix + "mask_logits"
    if old in state_dict and module.active_mask is not None:
        state_dict[prefix + "logits." + mask_key(module.active_mask)] = state_dict.pop(old)

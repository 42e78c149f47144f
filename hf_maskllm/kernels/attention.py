"""``attn_implementation="hf_maskllm"``: decode-step attention on CPU that reads only the cached positions
the mask lets through.

A static KV cache (what ``torch.compile`` and ``cache_implementation="static"`` need) is allocated for
its longest use, and the attention mask hides the positions not written yet. transformers' ``eager`` and
``sdpa`` attention still compute over every position of the cache, so a compiled decode step slows with
the cache's size (``max_cache_len``) rather than with the tokens in it. This implementation sends a step
of at most :data:`DECODE_MAX_TOKENS` query tokens on CPU to a C++ kernel (``decode_attention.cpp``,
registered as the torch op ``hf_maskllm::decode_attention`` with a fake implementation, so a compiled
graph holds one node per layer) that skips masked positions 8 at a time (a 64-bit word of the mask): a
step costs what the tokens in the cache cost. Everything else (longer prompts, GPUs, training, a float
mask, a position bias) goes to transformers' ``sdpa`` attention, unchanged; models whose attention uses
softcapping or attention sinks (which SDPA does not implement either), and Gemma 4 (whose code treats
the name ``sdpa`` specially), are refused. Importing :mod:`hf_maskllm` registers the name with
transformers' ``AttentionInterface`` and its boolean (``sdpa``) mask::

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="hf_maskllm")
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .cpu_extension import cpu_kernels

__all__ = ["ATTENTION_NAME", "DECODE_MAX_TOKENS", "decode_attention", "decode_attention_forward"]

ATTENTION_NAME = "hf_maskllm"
# query tokens per call that the C++ kernel serves (decode steps); longer calls take SDPA's kernels
DECODE_MAX_TOKENS = 8
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# attention features that neither the kernel nor SDPA implements (SDPA would silently ignore some): refused
_REFUSED_KWARGS = ("softcap", "s_aux", "sinks")
# features SDPA implements and the kernel does not: a call that uses one goes to SDPA
_SDPA_KWARGS = ("position_bias",)
# models whose code keeps SDPA's causal alignment only when the implementation is named "sdpa" (their
# prompt's forward drops query tokens otherwise): refused rather than computed wrong
_SDPA_BY_NAME = ("transformers.models.gemma4.", "transformers.models.gemma4_unified.")

_LIB = torch.library.Library("hf_maskllm", "FRAGMENT")  # held: the registration lives as long as it does
_LIB.define("decode_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor")


@torch.library.register_fake("hf_maskllm::decode_attention", lib=_LIB)
def _(query, key, value, mask, scale):
    batch, heads, tokens, _ = query.shape
    return query.new_empty((batch, tokens, heads, value.shape[-1]))


@torch.compiler.assume_constant_result
def _kernel_ready() -> bool:
    """Whether the C++ kernels are built (a constant for ``torch.compile``; loading them registers the op)."""
    return cpu_kernels() is not None


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Softmax attention of ``query [B, H, T, D]`` over ``key [B, KVH, L, D]`` / ``value [B, KVH, L, Dv]``
    (``H`` a multiple of ``KVH``), attending where the boolean ``mask`` (broadcast to ``[B, H, T, L]``) is
    true, everywhere without one. Returns ``[B, T, H, Dv]`` in the query's dtype; a row with nothing to
    attend gives zeros. CPU tensors of one dtype (float32, bfloat16, float16); no autograd."""
    if torch.compiler.is_compiling():
        return torch.ops.hf_maskllm.decode_attention(query, key, value, mask, scale)
    kernels = cpu_kernels()
    if kernels is None:
        raise RuntimeError(
            "hf_maskllm: decode_attention needs the CPU kernels, which could not be built (see the warning "
            "above); use attn_implementation='sdpa' instead."
        )
    return kernels.decode_attention(query, key, value, mask, scale)


def _served(module: torch.nn.Module, query, key, value, attention_mask, dropout, kwargs) -> bool:
    """Whether the C++ kernel computes this call as SDPA would, up to rounding (decided from static
    properties, so a compiled graph takes one branch without a guard on data)."""
    if query.device.type != "cpu" or query.dtype not in _DTYPES:
        return False
    if key.dtype != query.dtype or value.dtype != query.dtype or key.device != query.device:
        return False
    if not (query.dim() == key.dim() == value.dim() == 4):
        return False
    batch, heads, tokens = query.shape[:3]
    if not (
        statically_known_true(key.shape[0] == batch)
        and statically_known_true(value.shape[0] == batch)
        and statically_known_true(heads % key.shape[1] == 0)
        and statically_known_true(tokens <= DECODE_MAX_TOKENS)
    ):
        return False  # SDPA broadcasts what the kernel does not (a batch of one query against many keys)
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return False
    if dropout:  # SDPA applies dropout whenever it is given one
        return False
    if any(kwargs.get(name) is not None for name in _SDPA_KWARGS) or kwargs.get("output_attentions"):
        return False
    if attention_mask is None:
        # SDPA attends every position when there is no mask and one query token (or a non-causal module)
        is_causal = kwargs.get("is_causal")
        is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if not (statically_known_true(query.shape[2] == 1) or not is_causal):
            return False
    elif attention_mask.dtype != torch.bool or attention_mask.dim() != 4:
        return False
    elif not (
        all(
            statically_known_true(size == 1) or statically_known_true(size == full)
            for size, full in zip(attention_mask.shape[:3], (batch, heads, tokens))
        )
        and statically_known_true(attention_mask.shape[3] == key.shape[2])
    ):
        return False  # a mask that broadcasts otherwise (over the keys, say): SDPA's broadcasting rules
    return _kernel_ready()


def decode_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: decode steps on CPU through :func:`decode_attention`, the rest
    through ``sdpa_attention_forward``. Returns ``(output [B, T, H, Dv], None)``."""
    if type(module).__module__.startswith(_SDPA_BY_NAME):
        raise ValueError(
            f"attn_implementation='hf_maskllm' does not support {type(module).__name__}: the model's code "
            "treats attention named 'sdpa' specially; load it with attn_implementation='sdpa' instead."
        )
    if refused := [name for name in _REFUSED_KWARGS if kwargs.get(name) is not None]:
        raise ValueError(
            f"attn_implementation='hf_maskllm' does not support {' or '.join(refused)} (this model's attention "
            "uses it); load the model with attn_implementation='eager' instead."
        )
    if not _served(module, query, key, value, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return decode_attention(query, key, value, attention_mask, float(scale)), None


AttentionInterface.register(ATTENTION_NAME, decode_attention_forward)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)

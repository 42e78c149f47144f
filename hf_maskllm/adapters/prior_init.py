"""Initial mask logits: random init, the prior rule, and a config's prior resolved to hard masks.

Every mask of a :class:`~hf_maskllm.MaskModel` starts here: ``random_logits`` draws the normal
init, ``prior_masks`` turns ``MaskConfig.prior`` (a one-shot method on calibration data, or a saved
mask: transfer learning) into N:M hard masks, ``prior_logits`` applies the MaskLLM prior rule, and
``wanda_order`` orders each group's candidates by their Wanda error (``MaskConfig.wanda_strength``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, MaskFileError
from ..modules import dense_weight_view, is_conv1d
from ..patterns import candidate_patterns, mask_to_indices
from ..priors.calibration import PRIOR_METHODS, compute_prior_masks
from ..priors.wanda import input_norms
from .config import MaskConfig
from .mask_source import LayerMasks, open_mask_source

__all__ = [
    "TORCH_DTYPES",
    "apply_prior_rule",
    "initial_logits",
    "keep_lead",
    "prior_logits",
    "prior_masks",
    "random_logits",
    "saved_mask_prior",
    "wanda_order",
    "wanda_order_norms",
]

# The Wanda order's term per candidate is clipped to this many standard deviations of the init.
WANDA_ORDER_CLIP = 3.0

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def random_logits(
    config: MaskConfig, shapes: dict[str, tuple[int, int]], device: dict[str, torch.device] | None = None
) -> dict[str, torch.Tensor]:
    """``N(0, init_std)`` logits ``[out * in / m, C]`` per layer, seeded by ``config.seed``, in ``shapes`` order."""
    generator = torch.Generator().manual_seed(config.seed)
    dtype = TORCH_DTYPES[config.logits_dtype]
    out = {}
    for name, (out_f, in_f) in shapes.items():
        logits = torch.randn(out_f * in_f // config.m, config.num_candidates, generator=generator)
        logits = (logits * config.init_std).to(dtype)
        out[name] = logits if device is None else logits.to(device[name])
    return out


@torch.no_grad()
def prior_logits(
    logits: torch.Tensor,
    mask: torch.Tensor | list[torch.Tensor],
    n: int,
    m: int,
    alpha: float,
    init_std: float,
) -> torch.Tensor:
    """``logits + alpha * std(logits) * (overlap(candidate, mask) - n/2)`` (the paper's prior rule), same dtype.

    The prior's candidate then leads every group; where the random init noise would still beat it
    (a few percent of groups at alpha = 3), its logit is raised just above the group's maximum, so
    the hard mask of the result equals ``mask`` exactly (also after rounding to 16-bit logits).

    ``mask`` may be a list of masks (a combined prior): their terms add. A group where they all
    agree then leads by ``len(mask) * alpha`` standard deviations; where they disagree, the
    candidates they favour tie and the init noise picks the starting one, so learning decides.
    """
    masks = mask if isinstance(mask, list) else [mask]
    if not masks:
        raise ValueError("prior_logits needs at least one mask.")
    out = logits.float()
    cand = candidate_patterns(n, m, device=out.device)
    std = out.std() if out.numel() > 1 else out.new_tensor(init_std)
    prior_idx = [mask_to_indices(k.bool(), n, m) for k in masks]  # validates exact N:M
    # A group's term depends on its prior candidate alone: one row of a [C, C] table per group, gathered.
    table = alpha * std * (cand @ cand.t() - n / 2)  # [C, C]: overlap of candidate i's pattern with j's
    for idx in prior_idx:
        out += table[idx]
    if len(masks) > 1:
        return out.to(logits.dtype)
    return keep_lead(out, prior_idx[0], max(float(std) * 1e-3, 1e-6), logits.dtype)


def keep_lead(out: torch.Tensor, lead_idx: torch.Tensor, margin: float, dtype: torch.dtype) -> torch.Tensor:
    """``out`` (float32 ``[G, C]``) in ``dtype`` with candidate ``lead_idx`` the argmax of every group: where
    another candidate reaches it, its logit is raised ``margin`` above the group's maximum, and where rounding
    to a 16-bit ``dtype`` then ties or reorders them, to the next representable value above it."""
    best, leader = out.max(dim=1)
    losers = leader != lead_idx
    out[losers, lead_idx[losers]] = best[losers] + margin
    out = out.to(dtype)
    losers = out.argmax(dim=1) != lead_idx
    if bool(losers.any()):
        best = out[losers].max(dim=1).values
        out[losers, lead_idx[losers]] = torch.nextafter(best, torch.full_like(best, float("inf")))
    return out


@torch.no_grad()
def apply_prior_rule(
    logits: dict[str, torch.Tensor],
    priors: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]],
    shapes: dict[str, tuple[int, int]],
    n: int,
    m: int,
    alpha: float,
    init_std: float,
) -> dict[str, torch.Tensor]:
    """``{layer: logits}`` with the prior rule applied for ``priors`` (``{layer: [out, in] bool}``, or a
    list of such dicts whose terms add); each prior must cover exactly the layers of ``logits``, in the
    layers' ``shapes``. The one place every prior (one-shot, saved mask, hard masks being loaded) enters."""
    sources = priors if isinstance(priors, list) else [priors]
    for source in sources:
        unknown, missing = sorted(set(source) - set(logits)), sorted(set(logits) - set(source))
        if unknown or missing:
            raise MaskFileError(
                f"Prior masks do not match the masked layers: missing {missing[:3]}, unknown {unknown[:3]}. "
                "A prior must cover exactly the layers selected by target_modules."
            )
        for name in logits:
            if tuple(source[name].shape) != tuple(shapes[name]):
                raise MaskFileError(
                    f"Prior mask for {name} has shape {tuple(source[name].shape)}, the layer is "
                    f"{tuple(shapes[name])} ([out, in])."
                )
    return {
        name: prior_logits(
            tensor, [source[name].to(tensor.device) for source in sources], n, m, alpha, init_std
        )
        for name, tensor in logits.items()
    }


def initial_logits(
    config: MaskConfig,
    shapes: dict[str, tuple[int, int]],
    devices: dict[str, torch.device] | None = None,
    priors: list[dict[str, torch.Tensor]] | None = None,
    wanda: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """A new mask's logits: the config's seeded normal init, with the prior rule for ``priors`` when given,
    then the Wanda order at ``config.wanda_strength`` where ``wanda`` gives each layer's
    ``(weight [out, in], input norms [in])``."""
    logits = random_logits(config, shapes, devices)
    if not priors:
        return logits
    logits = apply_prior_rule(
        logits, priors, shapes, config.n, config.m, config.prior_strength, config.init_std
    )
    if not wanda or not config.wanda_strength:
        return logits
    beta, std = config.wanda_strength, config.init_std
    return {
        name: wanda_order(tensor, *wanda[name], config.n, config.m, beta, std)
        for name, tensor in logits.items()
    }


@torch.no_grad()
def wanda_order(
    logits: torch.Tensor,
    weight: torch.Tensor,
    norms: torch.Tensor,
    n: int,
    m: int,
    beta: float,
    init_std: float,
) -> torch.Tensor:
    """``logits - beta * init_std * clip(log e_c - mean_c log e_c, +-3)`` with the leading candidate of every
    group (the prior's) kept in the lead; same dtype as ``logits`` ``[G, C]``.

    ``e_c`` is candidate ``c``'s Wanda error: ``sum (W_j * norms_j)^2`` over the weights it prunes (``weight``
    ``[out, in]``, ``norms`` ``[in]``: the inputs' L2 norms). Where the term would let another candidate
    overtake the leader, the leader's logit is raised just above the group's maximum, so the hard mask is
    unchanged (also after rounding to 16-bit logits)."""
    cand = candidate_patterns(n, m, device=logits.device).float()
    lead_idx = logits.float().argmax(dim=1)
    energy = (weight.float() * norms.to(weight.device).float()[None]).pow(2).reshape(-1, m).to(logits.device)
    log_error = (energy @ (1 - cand).t() + 1e-30).log()  # [G, C]; 1e-30: an all-zero group ties
    term = -(log_error - log_error.mean(dim=1, keepdim=True)).clamp(-WANDA_ORDER_CLIP, WANDA_ORDER_CLIP)
    return keep_lead(logits.float() + beta * init_std * term, lead_idx, 1e-4, logits.dtype)


def wanda_order_norms(
    model: nn.Module, config: MaskConfig, targets: list[str], data: Any, tokenizer: Any
) -> dict[str, torch.Tensor]:
    """The input norms ``wanda_order`` needs: ``{layer: ||X_j||}`` of ``targets`` over the calibration data,
    in one pass of the (dense) ``model``."""
    tokens = _calibration_tokens(config, "wanda", data, tokenizer)
    return input_norms(model, targets, tokens)


def prior_masks(
    model: nn.Module,
    config: MaskConfig,
    targets: list[str],
    calibration_data: Any = None,
    tokenizer: Any = None,
) -> list[dict[str, torch.Tensor]] | None:
    """``[{layer: [out, in] bool}]``: the N:M masks of each source of ``config.prior`` for ``targets``.

    ``None`` without a prior; one dict per source otherwise (one for a single prior). A one-shot method
    calibrates on the (dense) ``model`` with ``calibration_data``; a saved mask (folder or Hub repo id)
    gives its hard masks: the transfer-learning path.
    """
    config.check_prior_source()
    sources = config.prior_sources
    if not sources:
        return None
    out = []
    for source in sources:
        if source in PRIOR_METHODS:
            tokens = _calibration_tokens(config, source, calibration_data, tokenizer)
            out.append(compute_prior_masks(model, source, config.n, config.m, targets, calibration=tokens))
        else:
            out.append(saved_mask_prior(config, model, targets, source))
    return out


def _calibration_tokens(config: MaskConfig, method: str, data: Any, tokenizer: Any) -> torch.Tensor | None:
    if method == "magnitude":
        return None
    if data is None:
        raise ConfigError(
            f"prior={method!r} needs calibration data: pass calibration_data= (token ids [S, L], or texts / a "
            "dataset together with tokenizer=), or use prior='magnitude'."
        )
    if isinstance(data, torch.Tensor):
        if data.dim() != 2 or data.dtype not in (torch.int64, torch.int32):
            raise ConfigError(
                f"calibration_data tensors must be integer token ids [S, L], got {tuple(data.shape)} {data.dtype}."
            )
        return data.long()
    if tokenizer is None:
        raise ConfigError("calibration_data given as text needs tokenizer= to turn it into tokens.")
    from ..data import calibration_tokens

    return calibration_tokens(
        data,
        tokenizer,
        num_samples=config.calibration_samples,
        seqlen=config.calibration_seqlen,
        seed=config.seed,
    )


def saved_mask_prior(
    config: MaskConfig, model: nn.Module, targets: list[str], source: str
) -> dict[str, torch.Tensor]:
    """Hard masks (``[out, in]`` bool) of the saved mask ``source`` for the layers ``targets`` of ``model``:
    any mask source (an hf_maskllm mask folder, NVlabs' ``mask_compressed.npz`` or PATCH's ``mask.npz``: the
    file, a folder or a Hub repo holding it), read with ``config``'s N:M."""
    modules = {name: model.get_submodule(name) for name in targets}
    shapes = {name: tuple(dense_weight_view(module).shape) for name, module in modules.items()}
    found = open_mask_source(source, default=MaskConfig(n=config.n, m=config.m))
    saved = found.config
    if (saved.n, saved.m) != (config.n, config.m):
        raise MaskFileError(
            f"Prior mask {source!r} is {saved.n}:{saved.m} but the config asks for {config.n}:{config.m}; "
            "use the same N:M."
        )
    transposed = {name for name, module in modules.items() if is_conv1d(module)}
    model_layers = {name for name, _ in model.named_modules()}
    cand = candidate_patterns(config.n, config.m, dtype=torch.bool)
    out = {}
    with LayerMasks(found, shapes, transposed, model_layers) as masks:
        for name, module in modules.items():
            idx = masks.indices(name, dense_weight_view(module))
            out[name] = cand[idx].reshape(shapes[name])
    return out

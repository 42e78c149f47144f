"""Sequential, block-by-block calibration that turns one-shot methods into N:M masks.

Protocol (as in the Wanda and SparseGPT reference code):

1. Find the stack of decoder blocks (the ``nn.ModuleList`` of repeated blocks holding the most
   target layers, e.g. ``model.layers``, ``transformer.h``, ``model.decoder.layers``).
2. Run the calibration batches through the model until block 0, where a forward pre-hook records
   the block's inputs (hidden states plus every argument: attention mask, position embeddings,
   position ids, cache position, ...) and stops the forward with a private exception.
3. For each block holding targets: hooks on its target linears accumulate statistics while the
   block runs on the cached inputs, batch by batch; then each target's mask is computed and applied
   (pruned weights zeroed, or SparseGPT's updated weights written) so that later blocks see pruned
   layers; then the block runs again to give the next block's inputs.
4. Targets outside the blocks (rare) are calibrated afterwards with full-model forwards.
5. Mask-only mode restores every changed weight bit for bit from a CPU copy.

Precision: each block runs, and SparseGPT solves, in ``compute_dtype``: by default float64 on a CPU
(float32 on an accelerator). A mask is a discrete choice: in float32 the last-bit differences between
thread counts or CPUs (the order of a matmul's sums) flip the choice in near-tied groups, and each flip
changes every later block's inputs, so two runs drift apart block by block. In float64 those
differences are ~1e-16 instead of ~1e-7 and the same model and text give the same masks. The block's
weights are cast for the pass and cast back exactly; a weight SparseGPT updates is rounded to the
model's dtype before later blocks see it. Code inside a block that computes in float32 on purpose
(RMSNorm in Llama, Qwen2, Gemma) still does.

Memory: the cached hidden states of one block for the whole calibration set (``samples x seqlen x
hidden`` in the compute dtype, on the model's device), one batch of activations, the block's weights
in the compute dtype, and the statistics of one block's target layers (``in x in`` float64 per layer
for SparseGPT, ``in`` for Wanda).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..errors import ConfigError, DataError, TargetError
from ..modules import dense_weight_view, is_linear
from ..patterns import check_nm_args
from .magnitude import magnitude_mask
from .sparsegpt import HessianStats, sparsegpt_layer
from .wanda import InputNormStats, wanda_mask

__all__ = [
    "PRIOR_METHODS",
    "compute_prior_masks",
    "find_decoder_blocks",
    "solve_layers_sequentially",
    "sparsegpt_prune",
    "sparsegpt_reconstruct",
]

PRIOR_METHODS = ("magnitude", "wanda", "sparsegpt")


class _StopForward(Exception):
    """Raised by the block-0 pre-hook to stop the forward once the block's inputs are recorded."""


# ---------------------------------------------------------------------------------------------
# Targets and weights
# ---------------------------------------------------------------------------------------------


def _resolve_targets(model: nn.Module, module_names: Sequence[str], m: int) -> dict[str, nn.Module]:
    modules = dict(model.named_modules())
    targets: dict[str, nn.Module] = {}
    for name in module_names:
        module = modules.get(name)
        if module is None:
            raise TargetError(
                f"module {name!r} is not in the model; pass names from `model.named_modules()` "
                "(e.g. 'model.layers.0.self_attn.q_proj')."
            )
        if not is_linear(module):
            raise TargetError(
                f"module {name!r} is a {type(module).__name__}; priors support only nn.Linear and "
                "transformers' Conv1D. Remove it from the targets."
            )
        in_features = dense_weight_view(module).shape[1]
        if in_features % m:
            raise TargetError(
                f"module {name!r} has {in_features} input features, not divisible by m={m}; "
                "exclude it from the targets or choose another m."
            )
        targets[name] = module
    return targets


def find_decoder_blocks(
    model: nn.Module, target_names: Sequence[str] = ()
) -> tuple[str, nn.ModuleList] | None:
    """The model's stack of repeated blocks: ``(name, ModuleList)``, or ``None`` if there is none.

    Among ``nn.ModuleList``s whose children all share one class, pick the one holding the most
    target modules, then the longest (so a list of MoE experts never wins over the layer stack).
    """
    best: tuple[int, int] | None = None
    found = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        prefix = f"{name}." if name else ""
        held = sum(1 for t in target_names if t.startswith(prefix))
        key = (held, len(module))
        if best is None or key > best:
            best, found = key, (name, module)
    return found


def _input_device(model: nn.Module) -> torch.device:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None and getattr(emb, "weight", None) is not None:
        return emb.weight.device
    return next(model.parameters()).device


def _check_calibration(calibration: Any, method: str) -> torch.Tensor:
    if calibration is None:
        raise DataError(
            f"calibration data is required for {method!r} (wanda and sparsegpt measure layer inputs); "
            "pass a LongTensor [num_samples, seqlen] of token ids, or use method='magnitude'."
        )
    if not torch.is_tensor(calibration) or calibration.dim() != 2 or calibration.dtype.is_floating_point:
        raise DataError(
            "calibration must be an integer tensor [num_samples, seqlen] of token ids, got "
            f"{type(calibration).__name__} {tuple(getattr(calibration, 'shape', ()))}."
        )
    if calibration.numel() == 0:
        raise DataError("calibration data is empty; pass at least one sequence of at least one token.")
    return calibration.long()


# ---------------------------------------------------------------------------------------------
# Block inputs
# ---------------------------------------------------------------------------------------------


class _BlockInputs:
    """Per-batch inputs of the current block: hidden states plus the other arguments it was called with."""

    def __init__(self) -> None:
        self.hidden: list[torch.Tensor] = []
        self.args: list[tuple] = []
        self.kwargs: list[dict[str, Any]] = []
        self.hidden_in_kwargs = False

    def cast(self, dtype: torch.dtype) -> None:
        """Cast every floating tensor (hidden states, position embeddings, float masks) to ``dtype``."""
        self.hidden = [_cast_floats(h, dtype) for h in self.hidden]
        self.args = [_cast_floats(a, dtype) for a in self.args]
        self.kwargs = [_cast_floats(k, dtype) for k in self.kwargs]

    def run(self, block: nn.Module, b: int) -> torch.Tensor:
        if self.hidden_in_kwargs:
            out = block(*self.args[b], hidden_states=self.hidden[b], **self.kwargs[b])
        else:
            out = block(self.hidden[b], *self.args[b], **self.kwargs[b])
        return out[0] if isinstance(out, (tuple, list)) else out


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with every floating tensor inside tuples, lists and dicts cast to ``dtype``."""
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cast_floats(v, dtype) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_cast_floats(v, dtype) for v in obj)
    return obj


@contextmanager
def _module_in_dtype(module: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Cast ``module``'s floating parameters and buffers to ``dtype`` for the block, back on exit.

    Widening is exact, and every value written inside is representable in the original dtype, so the
    way back is exact too.
    """
    saved: list[tuple[torch.Tensor, torch.dtype]] = []
    try:
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            if tensor.is_floating_point() and tensor.dtype != dtype:
                saved.append((tensor, tensor.dtype))
                tensor.data = tensor.data.to(dtype)
        yield
    finally:
        for tensor, original in saved:
            tensor.data = tensor.data.to(original)


def _capture_block_inputs(
    model: nn.Module, block: nn.Module, calibration: torch.Tensor, batch_size: int
) -> _BlockInputs:
    store = _BlockInputs()

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if args and torch.is_tensor(args[0]):
            store.hidden.append(args[0])
            store.args.append(tuple(args[1:]))
            store.kwargs.append(dict(kwargs))
        else:
            kwargs = dict(kwargs)
            store.hidden.append(kwargs.pop("hidden_states"))
            store.args.append(tuple(args))
            store.kwargs.append(kwargs)
            store.hidden_in_kwargs = True
        raise _StopForward

    device = _input_device(model)
    handle = block.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        for start in range(0, calibration.shape[0], batch_size):
            try:
                model(input_ids=calibration[start : start + batch_size].to(device))
            except _StopForward:
                continue
            raise TargetError("the model's forward never reached its first block; cannot calibrate it.")
    finally:
        handle.remove()
    return store


# ---------------------------------------------------------------------------------------------
# Statistics and per-layer solve
# ---------------------------------------------------------------------------------------------

_STATS = {"wanda": InputNormStats, "sparsegpt": HessianStats}
# (name, weight [out, in] in the compute dtype, Hessian 2/T X^T X [in, in] float64) -> new weight [out, in]
LayerSolve = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]


def _collect_stats(
    targets: dict[str, nn.Module], method: str, num_batches: int, run_batch: Callable[[int], None]
) -> dict[str, InputNormStats | HessianStats]:
    """Hook ``targets``, call ``run_batch(b)`` for every batch, return each target's statistics.

    Layers fed the very same input tensor (q/k/v, gate/up) compute the batch statistics once.
    """
    stats_cls = _STATS[method]
    stats = {
        name: stats_cls(dense_weight_view(mod).shape[1], device=mod.weight.device)
        for name, mod in targets.items()
    }
    shared: dict[int, tuple[torch.Tensor, Any]] = {}

    def make_hook(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            x = args[0]
            hit = shared.get(id(x))
            if hit is None or hit[0] is not x:
                hit = (x, stats_cls.increment(x))
                shared[id(x)] = hit
            stats[name].add(hit[1])

        return hook

    handles = [mod.register_forward_hook(make_hook(name)) for name, mod in targets.items()]
    try:
        for b in range(num_batches):
            run_batch(b)
            shared.clear()
    finally:
        for h in handles:
            h.remove()
    return stats


def _prune_targets(
    targets: dict[str, nn.Module],
    stats: dict[str, InputNormStats | HessianStats],
    method: str,
    n: int,
    m: int,
    blocksize: int,
    percdamp: float,
    originals: dict[str, torch.Tensor],
    masks: dict[str, torch.Tensor],
    fixed_masks: dict[str, torch.Tensor] | None = None,
    weight_dtypes: dict[str, torch.dtype] | None = None,
    solve: LayerSolve | None = None,
) -> None:
    """Compute each target's mask and apply it to the weight (keeping a CPU copy of the original).

    With ``fixed_masks`` (SparseGPT only), each target keeps its given mask and gets the OBS update for it.
    ``weight_dtypes``: each weight's dtype in the model, when the block runs in another one; the copy is
    kept, and the update rounded, in it. ``solve``: replaces the method's solve (no mask is recorded).
    """
    for name, module in targets.items():
        weight = module.weight
        dtype = weight.dtype if weight_dtypes is None else weight_dtypes[name]
        originals[name] = weight.detach().to("cpu", dtype=dtype, copy=True)
        w_oi = dense_weight_view(module)
        if solve is not None:
            w_oi.data.copy_(solve(name, w_oi.detach(), stats[name].hessian()).to(dtype))
            stats[name] = None
            continue
        if method == "wanda":
            mask = wanda_mask(w_oi, stats[name].norms(), n, m)
            w_oi.data.masked_fill_(~mask, 0)
        else:
            fixed = None if fixed_masks is None else fixed_masks[name].to(w_oi.device)
            new_w, mask = sparsegpt_layer(w_oi, stats[name].hessian(), n, m, blocksize, percdamp, fixed)
            w_oi.data.copy_(new_w.to(dtype))
        masks[name] = mask.cpu()
        stats[name] = None  # free the statistics early


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def _calibrate_sequentially(
    model: nn.Module,
    method: str,
    n: int,
    m: int,
    targets: dict[str, nn.Module],
    calibration: torch.Tensor,
    batch_size: int,
    progress: bool,
    blocksize: int,
    percdamp: float,
    keep_updates: bool,
    fixed_masks: dict[str, torch.Tensor] | None = None,
    compute_dtype: torch.dtype | None = None,
    solve: LayerSolve | None = None,
    label: str | None = None,
) -> dict[str, torch.Tensor]:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}.")
    dtype = _compute_dtype(model, compute_dtype)
    found = find_decoder_blocks(model, list(targets))
    per_block: list[dict[str, nn.Module]] = []
    outside = dict(targets)
    if found is not None:
        list_name, blocks = found
        prefix = f"{list_name}." if list_name else ""
        per_block = [{} for _ in blocks]
        for name in list(outside):
            if name.startswith(prefix):
                idx = int(name[len(prefix) :].split(".", 1)[0])
                per_block[idx][name] = outside.pop(name)
    last = max((i for i, t in enumerate(per_block) if t), default=-1)

    masks: dict[str, torch.Tensor] = {}
    originals: dict[str, torch.Tensor] = {}
    was_training = model.training
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    if use_cache is not None:
        config.use_cache = False
    model.eval()
    success = False
    try:
        if last >= 0:
            inputs = _capture_block_inputs(model, blocks[0], calibration, batch_size)
            inputs.cast(dtype)
            num_batches = len(inputs.hidden)
            for i in tqdm(
                range(last + 1), desc=label or f"{method} {n}:{m}", unit="block", disable=not progress
            ):
                block = blocks[i]
                dtypes = {name: module.weight.dtype for name, module in per_block[i].items()}
                with _module_in_dtype(block, dtype):
                    if per_block[i]:
                        stats = _collect_stats(
                            per_block[i], method, num_batches, lambda b, block=block: inputs.run(block, b)
                        )
                        _prune_targets(
                            per_block[i], stats, method, n, m, blocksize, percdamp, originals, masks,
                            fixed_masks, dtypes, solve,
                        )  # fmt: skip
                    if i < last:
                        for b in range(num_batches):
                            inputs.hidden[b] = inputs.run(block, b)
            del inputs
        if outside:
            # Layers outside the block stack: one more pass of the (already pruned) full model.
            device = _input_device(model)
            starts = range(0, calibration.shape[0], batch_size)

            def run_full(b: int) -> None:
                model(input_ids=calibration[starts[b] : starts[b] + batch_size].to(device))

            stats = _collect_stats(outside, method, len(starts), run_full)
            _prune_targets(
                outside, stats, method, n, m, blocksize, percdamp, originals, masks, fixed_masks, None, solve
            )
        success = True
    finally:
        if not (success and keep_updates):
            modules = dict(model.named_modules())
            for name, original in originals.items():
                modules[name].weight.data.copy_(original)
        model.train(was_training)
        if use_cache is not None:
            config.use_cache = use_cache
    return {name: masks[name] for name in targets if name in masks}


def _compute_dtype(model: nn.Module, compute_dtype: torch.dtype | None) -> torch.dtype:
    if compute_dtype is None:
        return torch.float64 if _input_device(model).type == "cpu" else torch.float32
    if compute_dtype not in (torch.float32, torch.float64):
        raise ConfigError(
            f"compute_dtype must be torch.float64, torch.float32 or None (float64 on a CPU), got {compute_dtype!r}."
        )
    return compute_dtype


def _check_method(method: object) -> str:
    if method not in PRIOR_METHODS:
        raise ConfigError(f"unknown prior method {method!r}; choose one of {', '.join(PRIOR_METHODS)}.")
    return method  # type: ignore[return-value]


def compute_prior_masks(
    model: nn.Module,
    method: str,
    n: int,
    m: int,
    module_names: list[str],
    calibration: torch.LongTensor | None = None,
    batch_size: int = 1,
    progress: bool = True,
    compute_dtype: torch.dtype | None = None,
) -> dict[str, torch.BoolTensor]:
    """One-shot N:M masks for ``module_names``, leaving the model's weights bit-identical.

    Args:
        model: a transformers model (``nn.Linear`` or GPT-2 ``Conv1D`` targets).
        method: ``"magnitude"`` (no data), ``"wanda"`` or ``"sparsegpt"`` (SparseGPT's mask; its weight
            update is used during calibration and then undone).
        n, m: keep ``n`` of every ``m`` consecutive inputs.
        module_names: names from ``model.named_modules()``.
        calibration: ``[num_samples, seqlen]`` token ids; required except for magnitude.
        batch_size: sequences per forward during calibration.
        progress: show a tqdm bar over blocks.
        compute_dtype: dtype the blocks run and SparseGPT solves in; ``None``: float64 on a CPU (the
            same masks across thread counts and CPUs), float32 on an accelerator.

    Returns:
        ``{name: mask}``: exactly N:M bool masks on CPU in ``[out, in]`` orientation (for ``Conv1D``,
        the mask of ``weight.T``).
    """
    method = _check_method(method)
    check_nm_args(n, m)
    targets = _resolve_targets(model, module_names, m)
    if method == "magnitude":
        return {name: magnitude_mask(dense_weight_view(mod), n, m).cpu() for name, mod in targets.items()}
    calibration = _check_calibration(calibration, method)
    if not targets:
        return {}
    return _calibrate_sequentially(
        model, method, n, m, targets, calibration, batch_size, progress, 128, 0.01, keep_updates=False,
        compute_dtype=compute_dtype,
    )  # fmt: skip


def sparsegpt_reconstruct(
    model: nn.Module,
    masks: dict[str, torch.Tensor],
    calibration: torch.LongTensor,
    n: int = 2,
    m: int = 4,
    batch_size: int = 1,
    progress: bool = True,
    blocksize: int = 128,
    percdamp: float = 0.01,
    compute_dtype: torch.dtype | None = None,
) -> None:
    """SparseGPT's OBS weight update for GIVEN N:M masks, block by block on ``calibration``, in place.

    ``masks``: ``{module name: bool [out, in]}`` (each exactly N:M). The targets' weights become the
    updated weights (rounded to the model's dtype), zero where a mask is False; the masks are kept
    exactly. If anything fails, the original weights are restored. ``compute_dtype``: as in
    :func:`compute_prior_masks`.
    """
    if not masks:
        raise TargetError("masks is empty; pass {module name: bool [out, in] mask} for the layers to update.")
    check_nm_args(n, m)
    targets = _resolve_targets(model, list(masks), m)
    for name, module in targets.items():
        mask = masks[name]
        if tuple(mask.shape) != tuple(dense_weight_view(module).shape) or mask.dtype != torch.bool:
            raise ConfigError(
                f"mask of {name!r} must be a bool tensor of shape {list(dense_weight_view(module).shape)} ([out, in]), "
                f"got {mask.dtype} {list(mask.shape)}."
            )
        if bool((mask.reshape(-1, m).sum(dim=1) > n).any()):
            raise ConfigError(
                f"mask of {name!r} keeps more than {n} of every {m} weights in some groups; pass N:M masks "
                "(e.g. MaskModel.hard_masks()) and the matching n, m."
            )
    calibration = _check_calibration(calibration, "sparsegpt")
    _calibrate_sequentially(
        model,
        "sparsegpt",
        n,
        m,
        targets,
        calibration,
        batch_size,
        progress,
        blocksize,
        percdamp,
        keep_updates=True,
        fixed_masks=masks,
        compute_dtype=compute_dtype,
    )


def sparsegpt_prune(
    model: nn.Module,
    n: int,
    m: int,
    module_names: list[str],
    calibration: torch.LongTensor,
    batch_size: int = 1,
    progress: bool = True,
    blocksize: int = 128,
    percdamp: float = 0.01,
    compute_dtype: torch.dtype | None = None,
) -> dict[str, torch.BoolTensor]:
    """SparseGPT baseline: prune ``module_names`` to N:M in place, with the OBS weight update.

    The model's target weights become the updated, N:M-sparse weights, rounded to the model's dtype
    (if anything fails, the original weights are restored). Returns the bool keep-masks (CPU,
    ``[out, in]``). ``compute_dtype``: as in :func:`compute_prior_masks`.
    """
    check_nm_args(n, m)
    targets = _resolve_targets(model, module_names, m)
    calibration = _check_calibration(calibration, "sparsegpt")
    if not targets:
        return {}
    return _calibrate_sequentially(
        model,
        "sparsegpt",
        n,
        m,
        targets,
        calibration,
        batch_size,
        progress,
        blocksize,
        percdamp,
        keep_updates=True,
        compute_dtype=compute_dtype,
    )


def solve_layers_sequentially(
    model: nn.Module,
    module_names: list[str],
    calibration: torch.LongTensor,
    solve: LayerSolve,
    n: int = 2,
    m: int = 4,
    batch_size: int = 1,
    progress: bool = True,
    compute_dtype: torch.dtype | None = None,
    label: str = "calibrate",
) -> None:
    """Run ``solve`` on each target with SparseGPT's protocol, then restore every weight bit for bit.

    ``solve(name, weight [out, in], hessian [in, in]) -> new weight [out, in]`` is called once per
    target, block by block, with the layer's weight in ``compute_dtype`` and its Hessian
    ``2/T * X^T X`` (float64) measured on inputs that already went through the earlier targets' new
    weights (rounded to the model's dtype): an error-compensating quantizer sees the quantized model
    so far. ``n, m``: the targets' pattern (their input width must divide by ``m``); ``label`` names the
    progress bar; the other arguments are as in :func:`compute_prior_masks`.
    """
    check_nm_args(n, m)
    targets = _resolve_targets(model, module_names, m)
    calibration = _check_calibration(calibration, label)
    if not targets:
        return
    _calibrate_sequentially(
        model, "sparsegpt", n, m, targets, calibration, batch_size, progress, 128, 0.01,
        keep_updates=False, compute_dtype=compute_dtype, solve=solve, label=label,
    )  # fmt: skip

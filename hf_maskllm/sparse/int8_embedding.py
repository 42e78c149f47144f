"""The output layer (and the input embedding tied to it) stored as int8 with one float16 scale per row.

A checkpoint saved with ``embedding="int8"`` stores the output embedding ``W [vocab, hidden]`` as

- ``P.qweight int8 [vocab, hidden]``: codes ``q`` in ``[-127, 127]``;
- ``P.scales float16 [vocab]``: row ``r`` is ``float(scales[r]) * q[r]``, computed in float32;

by round-to-nearest (``scale = absmax / 127`` rounded to float16 first, ``q = clamp(round(w / scale))``;
a row of zeros gets scale 0 and codes 0). ``P`` is the output layer's name (``lm_head``) when it is not
tied; when it is tied to the input embedding, the table is stored once under the input embedding's
name (``model.embed_tokens``) and both layers read it after loading: :class:`Int8Embedding` gathers
rows, :class:`Int8Linear` multiplies by it (the C++ kernel on CPU).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError, TargetError
from ..kernels.route import has_kernel_int8, int8_linear

__all__ = [
    "EMBEDDING_TYPES",
    "Int8Embedding",
    "Int8Linear",
    "dequantize_embeddings",
    "embedding_names",
    "int8_embedding_keys",
    "int8_embedding_tensors",
    "quantize_rows",
    "to_int8_embeddings",
    "validate_rows",
]

EMBEDDING_TYPES = ("int8",)  # what ``embedding=`` / ``quantization_config.embedding`` may name
_QMAX = 127


@torch.no_grad()
def quantize_rows(weight: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest ``(qweight int8 [out, in], scales float16 [out])`` of a float ``weight [out, in]``.

    Rows are quantized ``chunk`` at a time, so the float32 temporaries stay small beside a large vocabulary.
    """
    qweight = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(weight.shape[0], dtype=torch.float16, device=weight.device)
    for start in range(0, weight.shape[0], chunk):
        w = weight[start : start + chunk].detach().to(torch.float32)
        absmax = w.abs().amax(dim=1)
        if not bool(torch.isfinite(absmax).all()):
            raise CheckpointError("the output embedding holds NaN or inf; it cannot be quantized.")
        rows = (absmax / _QMAX).to(torch.float16)
        if not bool(torch.isfinite(rows).all()):
            raise CheckpointError(
                f"output embedding weights up to {float(absmax.max()):.3g} exceed what float16 scales hold; "
                "save without embedding='int8'."
            )
        scale = rows.to(torch.float32).unsqueeze(1)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.where(scale > 0, torch.round(w / safe), torch.zeros_like(w)).clamp_(-_QMAX, _QMAX)
        qweight[start : start + chunk], scales[start : start + chunk] = codes, rows
    return qweight, scales


def validate_rows(
    qweight: torch.Tensor, scales: torch.Tensor, out_features: int, in_features: int, name: str
) -> None:
    """Raise :class:`CheckpointError` unless ``qweight`` / ``scales`` are a well-formed int8 table of that shape."""
    where = f"int8 tensors of {name!r}"
    if qweight.dtype != torch.int8 or tuple(qweight.shape) != (out_features, in_features):
        raise CheckpointError(
            f"{where}: `qweight` must be int8 of shape {[out_features, in_features]}, got {qweight.dtype} "
            f"{list(qweight.shape)}; the checkpoint is corrupt or was written for another model."
        )
    if scales.dtype != torch.float16 or tuple(scales.shape) != (out_features,):
        raise CheckpointError(
            f"{where}: `scales` must be float16 of shape [{out_features}] (one per row), got {scales.dtype} "
            f"{list(scales.shape)}; the checkpoint is corrupt or was written for another model."
        )
    if qweight.device.type == "meta" or scales.device.type == "meta":
        raise CheckpointError(
            f"{where}: tensors were never loaded (still on the meta device); the file lacks them."
        )
    if not bool(torch.isfinite(scales).all()):
        raise CheckpointError(
            f"{where}: `scales` holds NaN or inf; the checkpoint is corrupt. Save or download it again."
        )
    if bool((qweight == -128).any()):
        raise CheckpointError(
            f"{where}: `qweight` holds the code -128, outside [-127, 127]; the checkpoint is corrupt. Save it again."
        )


class _Int8Rows(nn.Module):
    """Holds an int8 table ``qweight [rows, cols]`` and float16 ``scales [rows]`` as buffers."""

    def __init__(self, rows: int, cols: int, device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight_dtype = dtype or torch.get_default_dtype()
        self.register_buffer("qweight", torch.zeros(rows, cols, device=device, dtype=torch.int8))
        self.register_buffer("scales", torch.zeros(rows, device=device, dtype=torch.float16))

    @torch.no_grad()
    def dense_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dequantized ``[rows, cols]`` table (scale times code in float32, then ``dtype``)."""
        return (self.qweight.to(torch.float32) * self.scales.to(torch.float32)[:, None]).to(
            dtype or self.weight_dtype
        )

    def _apply(self, fn: Any, recurse: bool = True) -> _Int8Rows:
        # The scales stay float16 (the format's dtype): they follow device moves, never dtype casts.
        scales = self._buffers.pop("scales")
        try:
            super()._apply(fn, recurse)
        finally:
            self._buffers["scales"] = scales
        moved = fn(scales)
        self._buffers["scales"] = moved if moved.dtype == torch.float16 else scales.to(moved.device)
        probe = fn(torch.empty(0, dtype=self.weight_dtype, device=scales.device))
        if probe.is_floating_point():
            self.weight_dtype = probe.dtype
        return self


class Int8Embedding(_Int8Rows):
    """An input embedding reading int8 rows: ``embedding(ids) = scales[ids, None] * qweight[ids]`` in the model dtype."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, device, dtype)
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 with one float16 scale per row"

    @property
    def weight(self) -> torch.Tensor:
        """A fresh, detached dequantized copy of the table (writing to it changes nothing)."""
        dense = self.dense_weight()
        dense._is_hf_initialized = True
        return dense

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(input_ids, self.qweight).to(torch.float32)  # [..., H]
        scale = F.embedding(input_ids, self.scales.unsqueeze(1)).to(torch.float32)  # [..., 1]
        return (rows * scale).to(self.weight_dtype)


class Int8Linear(_Int8Rows):
    """An output layer ``y = x @ (scales[:, None] * qweight).T + b`` with int8 codes and one float16 scale per row.

    Untied, it holds ``qweight`` and ``scales`` as its own buffers. Tied (``embedding=``), it holds
    neither and reads the :class:`Int8Embedding`'s (not registered as a submodule, so the table is held
    and saved once, under the embedding's name).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        device: Any = None,
        dtype: torch.dtype | None = None,
        embedding: Int8Embedding | None = None,
    ) -> None:
        super().__init__(out_features, in_features, device if embedding is None else "meta", dtype)
        self.in_features, self.out_features = in_features, out_features
        if embedding is not None:
            if (embedding.num_embeddings, embedding.embedding_dim) != (out_features, in_features):
                raise TargetError(
                    f"the tied input embedding is [{embedding.num_embeddings}, {embedding.embedding_dim}], but the "
                    f"output layer is [{out_features}, {in_features}]."
                )
            del self._buffers["qweight"], self._buffers["scales"]
        object.__setattr__(self, "_embedding", embedding)  # read, not owned
        self.bias = (
            nn.Parameter(torch.zeros(out_features, device=device, dtype=self.weight_dtype)) if bias else None
        )

    @property
    def tied(self) -> bool:
        """Whether the codes are the tied input embedding's."""
        return self._embedding is not None

    def __getattr__(self, name: str) -> Any:
        embedding = self.__dict__.get("_embedding")
        if embedding is not None and name in ("qweight", "scales"):  # tied: the embedding's buffers
            return getattr(embedding, name)
        return super().__getattr__(name)

    def table(self) -> _Int8Rows:
        """The module holding the codes and scales: this layer, or the tied input embedding."""
        return self if self._embedding is None else self._embedding

    def extra_repr(self) -> str:
        tied = ", tied to the input embedding" if self.tied else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"int8 with one float16 scale per row{tied}"
        )

    @torch.no_grad()
    def dense_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dequantized ``[out, in]`` weight in ``dtype`` (default: the model's float dtype)."""
        table = self.table()
        return (table.qweight.to(torch.float32) * table.scales.to(torch.float32)[:, None]).to(
            dtype or self.weight_dtype
        )

    @property
    def weight(self) -> torch.Tensor:
        """A fresh, detached dequantized copy (writing to it changes nothing)."""
        dense = self.dense_weight()
        dense._is_hf_initialized = True
        return dense

    def _apply(self, fn: Any, recurse: bool = True) -> Int8Linear:
        if self._embedding is None:
            return super()._apply(fn, recurse)
        nn.Module._apply(self, fn, recurse)
        probe = fn(torch.empty(0, dtype=self.weight_dtype, device=self._embedding.scales.device))
        if probe.is_floating_point():
            self.weight_dtype = probe.dtype
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = self.table()
        qweight, scales, bias = table.qweight, table.scales, self.bias
        wants_grad = torch.is_grad_enabled() and (
            x.requires_grad or (bias is not None and bias.requires_grad)
        )
        if not wants_grad and has_kernel_int8(x, qweight):
            return int8_linear(x, qweight, scales, bias)
        weight = (qweight.to(torch.float32) * scales.to(torch.float32)[:, None]).to(x.dtype)
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


# ------------------------------------------------------------------------------------------------
# Finding and swapping the model's embeddings.
# ------------------------------------------------------------------------------------------------


def _name_of(model: nn.Module, module: nn.Module | None) -> str | None:
    if module is None:
        return None
    return next((name for name, mod in model.named_modules() if mod is module), None)


def embedding_names(model: nn.Module) -> tuple[str, str | None]:
    """``(output layer name, input embedding name if the two are tied, else None)``.

    Raises :class:`TargetError` if the model has no output embedding.
    """
    get_out = getattr(model, "get_output_embeddings", None)
    out = get_out() if callable(get_out) else None
    out_name = _name_of(model, out)
    if out_name is None:
        raise TargetError(
            f"{type(model).__name__} has no output embedding (get_output_embeddings()); drop embedding='int8'."
        )
    get_in = getattr(model, "get_input_embeddings", None)
    inp = get_in() if callable(get_in) else None
    in_name = _name_of(model, inp)
    if isinstance(out, Int8Linear):
        return out_name, (in_name if out.tied else None)
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    is_tied = in_name is not None and (
        tied.get(f"{out_name}.weight") == f"{in_name}.weight"
        or (getattr(out, "weight", None) is not None and out.weight is getattr(inp, "weight", None))
    )
    return out_name, (in_name if is_tied else None)


def to_int8_embeddings(model: nn.Module, quantize: bool = True) -> tuple[str, str | None]:
    """Replace the output layer (and the input embedding tied to it) by :class:`Int8Linear` /
    :class:`Int8Embedding`; returns :func:`embedding_names`.

    ``quantize=True`` quantizes the current float weight (round-to-nearest); ``False`` builds empty
    layers on the meta device for a loader to fill. Only a plain ``nn.Linear`` output layer (and a plain
    ``nn.Embedding``) are replaced; anything else is refused, naming it.
    """
    out_name, in_name = embedding_names(model)
    out = model.get_submodule(out_name)
    if isinstance(out, Int8Linear):
        return out_name, in_name
    if type(out) is not nn.Linear:
        raise TargetError(
            f"the output layer {out_name!r} is a {type(out).__name__}; embedding='int8' supports nn.Linear only."
        )
    dtype = out.weight.dtype
    device = "meta" if not quantize else out.weight.device
    embedding = None
    if in_name is not None:
        inp = model.get_submodule(in_name)
        if type(inp) is not nn.Embedding or inp.max_norm is not None:
            raise TargetError(
                f"the input embedding {in_name!r} tied to {out_name!r} is a {type(inp).__name__} (or uses max_norm); "
                "embedding='int8' supports a plain nn.Embedding only."
            )
        embedding = Int8Embedding(inp.num_embeddings, inp.embedding_dim, inp.padding_idx, device, dtype)
    layer = Int8Linear(out.in_features, out.out_features, out.bias is not None, device, dtype, embedding)
    if quantize:
        qweight, scales = quantize_rows(out.weight)
        layer.table().qweight, layer.table().scales = qweight, scales
        if out.bias is not None:
            layer.bias = nn.Parameter(out.bias.detach().clone(), requires_grad=out.bias.requires_grad)
    if embedding is not None:
        model.set_submodule(in_name, embedding)
        # the float weights transformers would tie no longer exist: the int8 head reads the table itself
        _record_tie(model, f"{out_name}.weight", None)
    model.set_submodule(out_name, layer)
    return out_name, in_name


def _record_tie(model: nn.Module, target: str, source: str | None) -> None:
    """Keep transformers' tied-weights mappings true to the layers: drop the tie of ``target`` (``source=None``:
    the int8 output layer reads the input embedding's table itself, so ``model.tie_weights()`` has nothing to
    tie) or restore it (``source``: float layers again).

    ``tie_weights()`` reads ``all_tied_weights_keys``, or recomputes the mapping from each model class's
    ``_tied_weights_keys``; a model whose class ties ``target`` gets an instance mapping without it, removed
    again when the tie is restored.
    """
    tied = getattr(model, "all_tied_weights_keys", None)
    if isinstance(tied, dict):
        if source is None:
            tied.pop(target, None)
        else:
            tied[target] = source
    for prefix, sub in model.named_modules():
        mapping = getattr(type(sub), "_tied_weights_keys", None)
        if not isinstance(mapping, dict) or not hasattr(sub, "get_expanded_tied_weights_keys"):
            continue
        local = target.removeprefix(f"{prefix}.") if prefix else target
        if local not in mapping or (prefix and local == target):
            continue
        if source is None:
            sub._tied_weights_keys = {k: v for k, v in mapping.items() if k != local}
        else:
            sub.__dict__.pop("_tied_weights_keys", None)


def int8_embedding_keys(model: nn.Module) -> dict[str, str | None]:
    """For a checkpoint writer that streams tensors: ``{float weight key: prefix of its int8 tensors, or None
    to drop it}``. Tied: the input embedding's weight becomes ``<input embedding>.qweight`` / ``.scales``, the
    output weight (if stored) is dropped; untied: the output weight becomes ``<output layer>.qweight`` / ``.scales``."""
    out_name, in_name = embedding_names(model)
    out = model.get_submodule(out_name)
    if type(out) is not nn.Linear:
        raise TargetError(
            f"the output layer {out_name!r} is a {type(out).__name__}; embedding='int8' supports nn.Linear only."
        )
    if in_name is None:
        return {f"{out_name}.weight": out_name}
    inp = model.get_submodule(in_name)
    if type(inp) is not nn.Embedding or inp.max_norm is not None:
        raise TargetError(
            f"the input embedding {in_name!r} tied to {out_name!r} is a {type(inp).__name__} (or uses max_norm); "
            "embedding='int8' supports a plain nn.Embedding only."
        )
    return {f"{in_name}.weight": in_name, f"{out_name}.weight": None}


def int8_embedding_tensors(model: nn.Module) -> tuple[list[str], dict[str, torch.Tensor]]:
    """What a save with ``embedding="int8"`` changes in ``model``'s state dict: ``(float keys to drop, int8
    tensors to add)``. A model already holding :class:`Int8Linear` changes nothing (its state dict holds the
    codes); a float one has its output weight quantized, stored under the input embedding's name if tied."""
    out_name, in_name = embedding_names(model)
    out = model.get_submodule(out_name)
    if isinstance(out, Int8Linear):
        return [], {}
    if type(out) is not nn.Linear:
        raise TargetError(
            f"the output layer {out_name!r} is a {type(out).__name__}; embedding='int8' supports nn.Linear only."
        )
    if in_name is not None:
        inp = model.get_submodule(in_name)
        if type(inp) is not nn.Embedding or inp.max_norm is not None:
            raise TargetError(
                f"the input embedding {in_name!r} tied to {out_name!r} is a {type(inp).__name__} (or uses max_norm); "
                "embedding='int8' supports a plain nn.Embedding only."
            )
    qweight, scales = quantize_rows(out.weight)
    prefix = in_name or out_name
    drop = [f"{out_name}.weight"] + ([f"{in_name}.weight"] if in_name else [])
    return drop, {f"{prefix}.qweight": qweight.cpu(), f"{prefix}.scales": scales.cpu()}


def dequantize_embeddings(model: nn.Module) -> None:
    """Replace :class:`Int8Linear` / :class:`Int8Embedding` layers by float ``nn.Linear`` / ``nn.Embedding``
    holding the dequantized weights (tied again where they were tied)."""
    for name, module in list(model.named_modules()):
        if not isinstance(module, Int8Linear):
            continue
        weight = nn.Parameter(module.dense_weight())
        linear = nn.Linear(
            module.in_features, module.out_features, bias=module.bias is not None, device="meta"
        )
        linear.weight = weight
        if module.bias is not None:
            linear.bias = nn.Parameter(module.bias.detach().clone())
        if module.tied:
            table = module.table()
            in_name = _name_of(model, table)
            emb = nn.Embedding(table.num_embeddings, table.embedding_dim, table.padding_idx, device="meta")
            emb.weight = weight
            model.set_submodule(in_name, emb)
            _record_tie(model, f"{name}.weight", f"{in_name}.weight")
        model.set_submodule(name, linear)
    for name, module in list(model.named_modules()):  # an int8 input embedding left without its output layer
        if isinstance(module, Int8Embedding):
            emb = nn.Embedding(module.num_embeddings, module.embedding_dim, module.padding_idx, device="meta")
            emb.weight = nn.Parameter(module.dense_weight())
            model.set_submodule(name, emb)

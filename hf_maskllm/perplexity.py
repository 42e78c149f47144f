"""Perplexity with the SparseGPT / MaskLLM protocol: the one evaluation path of hf_maskllm.

Texts are joined with ``"\\n\\n"``, tokenized once and cut into non-overlapping windows of ``seqlen``
tokens (remainder dropped, see :func:`hf_maskllm.data.tokenize_windows`). Each window is scored on
its own; perplexity is ``exp`` of the mean next-token NLL over every predicted token
(``W * (seqlen - 1)`` of them), computed from the logits in float32.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .data import tokenize_windows
from .errors import DataError

__all__ = ["evaluate_perplexity", "window_nll"]


def _device_of(model: torch.nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def _logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    try:
        takes_cache = "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes_cache = False
    # no KV cache for scoring (wrappers such as MaskModel show the base model's signature)
    out = model(input_ids=input_ids, use_cache=False) if takes_cache else model(input_ids=input_ids)
    logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if logits is None:
        raise DataError(
            f"The model returned {type(out).__name__} without `.logits`; evaluate_perplexity needs a causal LM "
            "whose forward(input_ids=...) returns logits [B, L, V] (or an object with .logits)."
        )
    return logits


def window_nll(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Summed next-token NLL of each window, in float32: logits ``[B, L, V]``, ids ``[B, L]`` -> ``[B]``."""
    sums = []
    for row_logits, row_ids in zip(logits, input_ids):  # one row at a time bounds the fp32 copy
        sums.append(F.cross_entropy(row_logits[:-1].float(), row_ids[1:], reduction="sum"))
    return torch.stack(sums)


def evaluate_perplexity(
    model: torch.nn.Module,
    tokenizer: Any,
    texts_or_dataset: Any,
    seqlen: int = 512,
    max_windows: int | None = None,
    batch_size: int = 1,
    progress: bool = True,
) -> float:
    """Perplexity of ``model`` on ``texts_or_dataset`` (anything :func:`hf_maskllm.data.load_texts`
    accepts, or already-tokenized windows as a LongTensor ``[W, L]``, for which ``tokenizer`` may be
    ``None`` and ``seqlen`` is ignored).

    Runs under ``torch.no_grad()`` in eval mode and restores every submodule's training flag afterwards.
    Only the first ``max_windows`` windows are scored when given.
    """
    if batch_size < 1:
        raise DataError(f"batch_size must be at least 1, got {batch_size}.")
    if isinstance(texts_or_dataset, torch.Tensor):
        windows = texts_or_dataset
        if windows.dim() != 2 or windows.dtype not in (torch.int64, torch.int32) or windows.shape[1] < 2:
            raise DataError(
                f"Token windows must be an integer tensor [W, L] with L >= 2, got {windows.dtype} "
                f"{tuple(windows.shape)}."
            )
        if windows.shape[0] == 0:
            raise DataError("Token windows are empty (W = 0); pass at least one window.")
        if max_windows is not None:
            windows = windows[:max_windows]
    else:
        windows = tokenize_windows(texts_or_dataset, tokenizer, seqlen, max_windows=max_windows)
    windows = windows.long()  # [W, L]

    device = _device_of(model)
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    total_nll = torch.zeros((), dtype=torch.float64)
    try:
        with torch.no_grad():
            for start in tqdm(
                range(0, windows.shape[0], batch_size), desc="perplexity", unit="batch", disable=not progress
            ):
                batch = windows[start : start + batch_size].to(device)  # [B, L]
                total_nll += window_nll(_logits(model, batch), batch).sum().double().cpu()
    finally:
        for module, training in modes:
            module.training = training
    num_tokens = windows.shape[0] * (windows.shape[1] - 1)
    return math.exp(total_nll.item() / num_tokens)

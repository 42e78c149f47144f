"""Model cards (README.md) for saved masks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..hub import is_hub_repo_id

if TYPE_CHECKING:
    from .config import MaskConfig

__all__ = ["mask_model_card", "merged_card_fields"]


def mask_model_card(
    base_model: str | None,
    n: int,
    m: int,
    num_layers: int,
    num_weights: int,
    bits_per_weight: float,
    targets: str | list[str],
    prior: str | list[str] | None,
    summary: dict[str, Any],
    mask_name: str = "default",
) -> str:
    """Markdown with YAML front matter describing a learned N:M mask (``mask_name``: its name in a MaskModel)."""
    lines = ["---", "library_name: hf_maskllm"]
    if base_model and is_hub_repo_id(base_model):  # the Hub validates this field: no local paths
        lines.append(f"base_model: {base_model}")
    lines += ["tags:", "- maskllm", "- sparsity", f"- {n}:{m}-sparsity", "---", ""]
    lines += [
        f"# {n}:{m} sparsity mask{f' {mask_name!r}' if mask_name != 'default' else ''}"
        f"{f' for {base_model}' if base_model else ''}",
        "",
        "A learned semi-structured sparsity mask made with hf_maskllm (MaskLLM,",
        f"learnable {n}:{m} masks sampled with Gumbel softmax, the model's weights frozen).",
        "",
        "| | |",
        "|---|---|",
        f"| base model | {base_model or 'unknown'} |",
        f"| mask name | {mask_name} |",
        f"| pattern | {n}:{m} (keep {n} of every {m} consecutive input weights) |",
        f"| masked layers | {num_layers} ({num_weights:,} weights) |",
        f"| targets | `{targets}` |",
        f"| prior | {(' + '.join(prior) if isinstance(prior, list) else prior) or 'none (random logits)'} |",
        f"| storage | {bits_per_weight:.3f} bits per masked weight |",
    ]
    for key in sorted(summary):
        lines.append(f"| {key.replace('_', ' ')} | {summary[key]} |")
    lines += [
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        "from hf_maskllm import MaskModel",
        "",
        f'base = AutoModelForCausalLM.from_pretrained("{base_model or "<base model>"}")',
        f'mask_model = MaskModel.from_pretrained(base, "<this folder or repo id>", mask_name="{mask_name}")',
        "sparse = mask_model.merge_and_unload()  # plain transformers model, exactly N:M",
        "# or, beside other masks of the same base model:",
        f'# other_mask_model.load_mask("<this folder or repo id>", mask_name="{mask_name}")',
        "```",
        "",
    ]
    return "\n".join(lines)


def merged_card_fields(
    config: MaskConfig, summary: dict[str, Any], mask_name: str = "default"
) -> dict[str, Any]:
    """The rows a merged (compressed) checkpoint's model card adds about the mask merged into it."""
    fields: dict[str, Any] = {}
    if config.base_model_name_or_path:
        fields["base_model"] = config.base_model_name_or_path
    if mask_name != "default":
        fields["mask"] = mask_name
    fields["how the mask was learned"] = (
        f"MaskLLM (hf_maskllm): learnable {config.n}:{config.m} masks sampled with Gumbel softmax, weights "
        f"frozen; prior: {' + '.join(config.prior_sources) or 'none'}"
    )
    fields.update({key.replace("_", " "): value for key, value in sorted(summary.items())})
    return fields

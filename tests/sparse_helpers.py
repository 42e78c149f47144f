"""Merged N:M models and a Python without hf_maskllm, shared by the sparse tests (``from sparse_helpers import ...``).

The tiny models here differ from ``models.py``'s: plain transformers configs, ``VOCAB`` tokens, and
``merged_model`` magnitude-prunes them to 2:4 as a merged MaskModel would be. ``tokens`` / ``args`` /
``NMEveryStep`` drive short Trainer runs on compressed models.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    TrainerCallback,
    TrainingArguments,
)

from hf_maskllm import check_nm
from hf_maskllm.sparse import SparseLinear

VOCAB = 128


def tiny_llama() -> LlamaForCausalLM:
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        tie_word_embeddings=True,  # like SmolLM2
    )
    return LlamaForCausalLM(cfg)


def tiny_gpt2() -> GPT2LMHeadModel:
    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB))


def tiny_opt() -> OPTForCausalLM:
    cfg = OPTConfig(
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=VOCAB,
        word_embed_proj_dim=64,
        max_position_embeddings=64,
    )
    return OPTForCausalLM(cfg)


def tiny_qwen2() -> Qwen2ForCausalLM:
    cfg = Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(cfg)


MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2, "opt": tiny_opt, "qwen2": tiny_qwen2}


@torch.no_grad()
def magnitude_prune(model: torch.nn.Module, n: int = 2, m: int = 4) -> None:
    """Zero all but the n largest |w| of every m inputs in each linear / Conv1D except the output embedding."""
    head = model.get_output_embeddings()
    for module in model.modules():
        is_conv1d = type(module).__name__ == "Conv1D"  # GPT-2: weight stored [in, out]
        if module is head or not (isinstance(module, torch.nn.Linear) or is_conv1d):
            continue
        weight = module.weight.t().contiguous() if is_conv1d else module.weight.clone()  # [out, in]
        groups = weight.view(weight.shape[0], -1, m)
        groups.scatter_(-1, groups.abs().argsort(dim=-1)[..., : m - n], 0.0)
        module.weight.copy_(weight.t() if is_conv1d else weight)


def merged_model(kind: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = MODELS[kind]()
    with torch.no_grad():  # initialise biases away from zero so that they are checked too
        for module in model.modules():
            if getattr(module, "bias", None) is not None and isinstance(module.bias, torch.nn.Parameter):
                module.bias.normal_(0, 0.1)
    magnitude_prune(model)
    return model.to(dtype).eval()


def run_without_hf_maskllm(script: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh offline Python where hf_maskllm is not importable from the path or the cwd.

    The script should end with ``assert "hf_maskllm" not in sys.modules``; a failing script fails the test.
    """
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": ""}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=cwd)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


# ---------------------------------------------------------------------------------------------- short Trainer runs
SEQ = 16


def tokens(num: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 128, (num, SEQ), generator=torch.Generator().manual_seed(seed))


def args(tmp_path, **overrides) -> TrainingArguments:
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=4,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def values_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: mod.values.detach().clone() for n, mod in model.named_modules() if isinstance(mod, SparseLinear)
    }


class NMEveryStep(TrainerCallback):
    """Records, after every optimizer step, the N:M violations of the dense weights the model computes with."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.violations = model, []

    def on_step_end(self, args, state, control, **kwargs):
        self.violations.append(len(check_nm(self.model, 2, 4).violations))


def assert_logits_close(
    got: torch.Tensor, expected: torch.Tensor, what: str = "logits", computed_in: torch.dtype | None = None
) -> None:
    """Outputs computed by another route than the expected ones (CPU kernels and torch's own matmuls are
    chosen per instruction set, and compiled graphs may decompose ops: sums in another order): float32
    within the default tolerance; 16-bit ones, rounded at every layer, within one unit in the last place
    at the largest output's scale. ``computed_in`` names the model's dtype where the outputs were upcast
    after it (``generate`` returns float32 logits on some transformers versions)."""
    dtype = computed_in or expected.dtype
    atol = None
    if dtype in (torch.bfloat16, torch.float16):
        atol = torch.finfo(dtype).eps * float(expected.abs().max())
    torch.testing.assert_close(
        got, expected, atol=atol, rtol=None if atol is None else 1.6e-2, msg=lambda m: f"{what}: {m}"
    )

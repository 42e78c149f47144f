"""The main job end to end on the real SmolLM2-135M (tiny budget): table, saved mask, compressed model."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from hf_maskllm.errors import DataError


def test_cli_refuses_training_on_heldout_text(tmp_path):
    from hf_maskllm.cli import main

    with pytest.raises(DataError, match="held-out"):
        main(["learn", "--train-data", "wikipedia", "--output", str(tmp_path)])


@pytest.fixture(scope="module")
def main_job(tmp_path_factory) -> tuple[Path, str]:
    """One run of the main job (tiny budget): its output folder and what it printed."""
    import contextlib
    import io

    from hf_maskllm.cli import main

    out = tmp_path_factory.mktemp("main-job")
    args = [
        "--prior",
        "magnitude",
        "--steps",
        "2",
        "--eval-windows",
        "1",
        "--eval-seqlen",
        "128",
        "--tau",
        "3",
        "0.5",
        "--prior-strength",
        "2.5",
        "--wanda-strength",
        "2",
        "--init-std",
        "0.02",
        "--kappa",
        "50",
        "400",
        "--lr-schedule",
        "cosine",
        # a little calibration text for the Wanda order (--wanda-strength): the CLI's wiring, not its quality
        "--calib-samples",
        "4",
        "--calib-seqlen",
        "64",
        "--sample-tokens",
        "8",
    ]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(["learn", *args, "--seqlen", "64", "--output", str(out)])
    return out, printed.getvalue()


@pytest.mark.slow
def test_main_job_on_smollm2(main_job):
    from transformers import AutoModelForCausalLM

    from hf_maskllm import MaskModel, check_nm
    from hf_maskllm.embedded import load_smollm2

    tmp_path, printed = main_job
    assert "| dense" in printed and "| prior (magnitude)" in printed and "MaskLLM (256 tokens)" in printed
    results = json.loads((tmp_path / "results.json").read_text())
    ppl = results["perplexity"]
    assert ppl["dense"]["wikipedia"] < ppl["prior (magnitude)"]["wikipedia"]  # 2:4 magnitude hurts
    assert all(torch.isfinite(torch.tensor(v["news"])) for v in ppl.values())
    # the saved mask restores onto a fresh model, and the compressed model loads and is exactly 2:4
    model, _ = load_smollm2()
    restored = MaskModel.from_pretrained(model, tmp_path / "mask")
    assert restored.training_summary["optimizer_steps"] == 2
    saved_config = json.loads((tmp_path / "mask" / "mask_config.json").read_text())
    assert (
        saved_config["tau"] == [3.0, 0.5] and saved_config["prior_strength"] == 2.5
    )  # --tau, --prior-strength
    assert saved_config["init_std"] == 0.02 and saved_config["kappa"] == [50.0, 400.0]  # --init-std, --kappa
    assert saved_config["wanda_strength"] == 2.0  # --wanda-strength: calibrated on the training text
    assert (saved_config["calibration_samples"], saved_config["calibration_seqlen"]) == (4, 64)  # --calib-*
    lrs = [h["learning_rate"] for h in results["log_history"] if "learning_rate" in h]
    # --lr-schedule cosine, the paper's decay from 5e-4 to 5e-5: the second of two steps runs at the midpoint
    assert lrs and lrs[-1] == pytest.approx(5e-5 + (5e-4 - 5e-5) / 2)
    sparse = AutoModelForCausalLM.from_pretrained(tmp_path / "sparse-model")
    assert check_nm(sparse, 2, 4).ok
    card = (tmp_path / "sparse-model" / "README.md").read_text()
    assert "heldout ppl wikipedia" in card and "prior: magnitude" in card
    # dense and 2:4 continuations of the same prompts, side by side, with the decoding settings stated
    sample = results["sample"]
    assert len(sample["dense"]) == len(sample["sparse"]) == len(sample["prompts"]) >= 2
    assert all(text.strip() for text in sample["dense"] + sample["sparse"])
    assert sample["dense"] != sample["sparse"]  # the dense continuation really ran without masks
    assert "repetition_penalty=1.3" in printed and f"dense:  {sample['dense'][0]!r}" in printed
    assert sample["decoding"]["max_new_tokens"] == 8 and "8 new tokens" in printed  # --sample-tokens
    assert "loaded from" in printed


def test_cli_refuses_negative_steps_and_sample_lengths_before_loading(tmp_path):
    from hf_maskllm.cli import main
    from hf_maskllm.errors import ConfigError

    with pytest.raises(ConfigError, match="--sample-tokens must be 0"):
        main(["learn", "--sample-tokens", "-1", "--output", str(tmp_path)])
    with pytest.raises(ConfigError, match="--steps must be 0"):
        main(["learn", "--steps", "-1", "--output", str(tmp_path)])


def test_cli_refuses_an_invalid_mask_name_before_loading(tmp_path):
    from hf_maskllm.cli import main
    from hf_maskllm.errors import MaskLLMError

    with pytest.raises(MaskLLMError, match="Invalid mask name 'a/b'"):
        main(["learn", "--mask-name", "a/b", "--output", str(tmp_path)])


@pytest.mark.slow
def test_downstream_job_learns_a_named_mask_from_a_saved_prior(tmp_path, main_job):
    """`learn --prior <general mask> --train-data <domain file> --mask-name <name>` writes <output>/mask/<name>."""
    from hf_maskllm import MaskModel
    from hf_maskllm.cli import main
    from hf_maskllm.embedded import load_smollm2

    general = main_job[0]  # the main job's mask is the general mask
    domain = tmp_path / "domain.jsonl"
    texts = [
        json.dumps({"text": line}) for line in open(json.__file__, encoding="utf-8").read().split("\n\n")
    ]
    domain.write_text("\n".join(texts), encoding="utf-8")
    # the recommended transfer: the general mask and a one-shot mask of the domain together as the prior
    args = [
        "--prior",
        str(general / "mask"),
        "magnitude",
        "--train-data",
        str(domain),
        "--mask-name",
        "json-code",
    ]
    main(["learn", *args, "--steps", "1", "--eval-windows", "1", "--eval-seqlen", "64", "--seqlen", "64"]
         + ["--no-merged", "--sample-tokens", "0", "--output", str(tmp_path / "task")])  # fmt: skip
    assert (tmp_path / "task" / "mask" / "json-code" / "mask_config.json").is_file()
    model, _ = load_smollm2()
    served = MaskModel.from_pretrained(model, general / "mask", mask_name="general")
    served.load_mask(tmp_path / "task" / "mask" / "json-code", mask_name="json-code")
    assert served.mask_configs["json-code"].prior == [str(general / "mask"), "magnitude"]
    assert served.training_summary["optimizer_steps"] == 2  # the general mask's run
    served.set_mask("json-code")
    assert served.training_summary["optimizer_steps"] == 1
    assert served.training_summary["prior"] == f"{general / 'mask'} + magnitude"


@pytest.mark.slow
def test_cli_takes_the_reference_mask_file_as_its_prior(tmp_path, main_job):
    """`learn --prior mask_compressed.npz --steps 0` scores a published mask: the prior the run evaluates is
    exactly the file's mask, here the main job's learned mask written in the reference's format."""
    import io

    from hf_maskllm import MaskModel
    from hf_maskllm.cli import main
    from hf_maskllm.embedded import load_smollm2

    general, _ = main_job
    model, _ = load_smollm2()
    MaskModel.from_pretrained(model, general / "mask").save_pretrained(tmp_path / "reference", format="npz")
    npz = tmp_path / "reference" / "mask_compressed.npz"
    printed = io.StringIO()
    args = [
        "--prior",
        str(npz),
        "--steps",
        "0",  # score and save the prior alone
        "--eval-windows",
        "1",
        "--eval-seqlen",
        "128",
        "--sample-tokens",
        "0",  # no continuations: this run checks the prior
    ]
    with contextlib.redirect_stdout(printed):
        main(["learn", *args, "--no-merged", "--output", str(tmp_path / "out")])
    ppl = json.loads((tmp_path / "out" / "results.json").read_text())["perplexity"]
    learned = json.loads((general / "results.json").read_text())["perplexity"]["MaskLLM (256 tokens)"]
    assert ppl[f"prior ({npz})"] == pytest.approx(learned, rel=1e-6)  # the same hard masks, the same windows
    saved_config = json.loads((tmp_path / "out" / "mask" / "mask_config.json").read_text())
    assert saved_config["prior"] == str(npz)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["sample"] is None and "continuations" not in printed.getvalue()  # --sample-tokens 0
    assert list(ppl) == ["dense", f"prior ({npz})"] and results["log_history"] == []  # --steps 0: no learning
    assert "MaskLLM" not in printed.getvalue()

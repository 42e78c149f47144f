"""The main job end to end on the real SmolLM2-135M (tiny budget): table, saved mask, compressed model."""

from __future__ import annotations

import json

import pytest
import torch

from hf_maskllm.errors import DataError


def test_cli_refuses_training_on_heldout_text(tmp_path):
    from hf_maskllm.cli import main

    with pytest.raises(DataError, match="held-out"):
        main(["learn", "--train-data", "wikipedia", "--output", str(tmp_path)])


@pytest.mark.slow
def test_main_job_on_smollm2(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from hf_maskllm import MaskModel, check_nm
    from hf_maskllm.cli import main
    from hf_maskllm.embedded import load_smollm2

    args = ["--prior", "magnitude", "--steps", "2", "--eval-windows", "1", "--eval-seqlen", "128"]
    main(["learn", *args, "--seqlen", "64", "--output", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "| dense" in printed and "| prior (magnitude)" in printed and "MaskLLM (256 tokens)" in printed
    results = json.loads((tmp_path / "results.json").read_text())
    ppl = results["perplexity"]
    assert ppl["dense"]["wikipedia"] < ppl["prior (magnitude)"]["wikipedia"]  # 2:4 magnitude hurts
    assert all(torch.isfinite(torch.tensor(v["news"])) for v in ppl.values())
    # the saved mask restores onto a fresh model, and the compressed model loads and is exactly 2:4
    model, _ = load_smollm2()
    restored = MaskModel.from_pretrained(model, tmp_path / "mask")
    assert restored.training_summary["optimizer_steps"] == 2
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
    assert "loaded from" in printed

"""DDP through a plain Trainer (torchrun, gloo on CPU): every rank ends with identical logits and masks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

HERE = Path(__file__).parent


@pytest.mark.slow
def test_ddp_two_processes_agree(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    # --standalone: torchrun picks a free local port for its own rendezvous
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run(
        [*cmd, str(HERE / "ddp_train.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-4000:])
    ranks = [load_file(tmp_path / f"rank{r}.safetensors") for r in (0, 1)]
    assert int(ranks[0]["world_size"]) == 2
    assert ranks[0].keys() == ranks[1].keys()
    for key in ranks[0]:
        assert torch.equal(ranks[0][key], ranks[1][key]), key
    probes = [load_file(tmp_path / f"probe{r}.safetensors")["noise_probe"] for r in (0, 1)]
    assert not torch.equal(probes[0], probes[1])  # each rank samples its own masks
    # and training moved the logits away from their (shared) initialisation
    from models import tiny_llama

    from hf_maskllm import MaskConfig, get_mask_model

    init = get_mask_model(tiny_llama(seed=0), MaskConfig(prior="magnitude"))
    moved = [
        not torch.equal(layer.mask_logits.detach(), ranks[0][f"{name}.logits"])
        for name, layer in init.masked_layers().items()
    ]
    assert all(moved)

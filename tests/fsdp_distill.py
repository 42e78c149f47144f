"""Run by tests/test_bypass_and_configs.py under torchrun: one distilling training forward and backward of a
tiny Llama sharded with FSDP2 (gloo, CPU), each process on its half of one batch.

``python fsdp_distill.py OUT``. Every rank writes ``OUT/rank<rank>.json``: its share of each objective term
(the term as the whole batch's loss divides it) and, from rank 0, ``OUT/grads.safetensors``: every layer's
full logits gradient (``DTensor.full_tensor``). The test repeats both halves in one process and compares.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).parent))
from models import tiny_llama  # noqa: E402

from hf_maskllm import MaskConfig, get_mask_model  # noqa: E402

OBJECTIVE = {"distill_logits": 0.7, "distill_temperature": 2.0, "distill_hidden": 0.3, "lm_weight": 0.5}


def build():
    """The distilling MaskModel (float32 logits, no regulariser) at a point of its schedule."""
    config = MaskConfig(prior="magnitude", logits_dtype="float32", sparse_reg=0.0, **OBJECTIVE)
    mm = get_mask_model(tiny_llama(), config).train()
    mm.set_schedule_progress(0.3)
    return mm


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """4 sequences with labels left out at different places: the two halves count different tokens."""
    ids = torch.randint(3, 128, (4, 12), generator=torch.Generator().manual_seed(11))
    labels = ids.clone()
    labels[0, :5] = -100
    labels[3, -4:] = -100
    return ids, labels


def seed(rank: int) -> int:
    """Each process draws its own mask sample; the single-process repetition draws the same one."""
    return 100 + rank


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mm = build()
    for block in mm.base_model.model.layers:
        fully_shard(block)
    fully_shard(mm)
    ids, labels = batch()
    items = torch.tensor(int((labels[:, 1:] != -100).sum()))  # the whole batch's count, as the Trainer passes
    part = slice(rank * 2, rank * 2 + 2)
    torch.manual_seed(seed(rank))
    outputs = mm(input_ids=ids[part], labels=labels[part], num_items_in_batch=items)
    (outputs.loss * world).backward()  # FSDP averages the gradients over processes; the objective sums
    count = int((labels[part][:, 1:] != -100).sum())
    shares = {
        name: float(outputs[f"{name}_loss"]) * count / int(items)
        for name in ("distill_logits", "distill_hidden")
    }
    (out / f"rank{rank}.json").write_text(json.dumps(shares))
    grads = {}
    for name, layer in mm.masked_layers().items():
        grad = layer.mask_logits.grad
        grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).contiguous()
    if rank == 0:
        save_file(grads, out / "grads.safetensors")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

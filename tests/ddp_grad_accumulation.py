"""Run by tests/test_grad_accumulation.py under torchrun: bf16 logit gradients accumulated and all-reduced by DDP.

``python ddp_grad_accumulation.py OUT OBJECTIVE [OBJECTIVE ...]``: one launch checks every objective named, in
turn; rank 0 writes ``OUT``, ``{objective: {"rel": ..., "dtype": ...}}``.
"""

from __future__ import annotations

import json
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_grad_accumulation import ddp_relative_error  # noqa: E402


def main(out: str, objectives: list[str]) -> None:
    torch.distributed.init_process_group("gloo")
    try:
        torch.set_num_threads(1)
        results = {}
        for objective in objectives:
            rel, dtype = ddp_relative_error(objective)
            results[objective] = {"rel": rel, "dtype": dtype}
        if torch.distributed.get_rank() == 0:
            with open(out, "w") as f:
                json.dump(results, f)
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

"""Run by tests/test_grad_accumulation.py under torchrun: bf16 logit gradients accumulated and all-reduced by DDP."""

from __future__ import annotations

import json
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_grad_accumulation import ddp_relative_error  # noqa: E402


def main(out: str, objective: str) -> None:
    torch.distributed.init_process_group("gloo")
    try:
        torch.set_num_threads(1)
        rel, dtype = ddp_relative_error(objective)
        if torch.distributed.get_rank() == 0:
            with open(out, "w") as f:
                json.dump({"rel": rel, "dtype": dtype}, f)
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

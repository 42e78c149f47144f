"""Run by tests/test_distributed.py under torchrun: a plain Trainer learning masks with FSDP2 (gloo, CPU).

``python fsdp_train.py OUT [--ddp] [--optimizer adamw|maskadamw] [--lr LR] [--logits-dtype DTYPE]``.
Every rank writes ``OUT/evidence<rank>.json`` (how each layer's logits are placed, the Trainer's logs)
and ``OUT/full<rank>.safetensors`` (the trained logits, gathered with ``DTensor.full_tensor``); the
main process saves the mask gathered before training (``OUT/mask_step0``) and after it (``OUT/mask``,
with logits) the way a user script would: ``accelerator.get_state_dict`` on every process, then
``save_pretrained(state_dict=...)`` on rank 0. ``--ddp`` trains the same run with DDP instead. Under ``accelerate launch`` with an FSDP config file
(``ACCELERATE_USE_FSDP=true``) the FSDP settings come from that file, else from ``FSDP_CONFIG`` below.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from datasets import Dataset
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_maskllm import MaskAdamW, MaskAnnealCallback, MaskConfig, MaskModel, get_mask_model

sys.path.insert(0, str(Path(__file__).parent))
from models import tiny_llama  # noqa: E402

FSDP_CONFIG = {
    "version": 2,
    "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
    "state_dict_type": "FULL_STATE_DICT",
    "reshard_after_forward": True,
}


def enable_fsdp_on_cpu(trainer: Trainer) -> None:
    """accelerate turns its FSDP plugin on only for accelerator devices (CUDA, XPU, ...); with CPU processes
    (``DistributedType.MULTI_CPU``) it drops the plugin and trains with DDP. FSDP2 itself runs on CPU with
    gloo, so switch the (process-wide) accelerate state to FSDP before ``train()`` prepares the model."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    if state.distributed_type == DistributedType.MULTI_CPU:
        # as AcceleratorState.__init__ does for GPUs: both shared states, or the next AcceleratorState() resets it
        state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        # from TrainingArguments(fsdp_config=...), else from the FSDP_* variables `accelerate launch` sets
        state.fsdp_plugin = FullyShardedDataParallelPlugin(**(trainer.args.fsdp_plugin_args or {}))
        trainer.is_fsdp_enabled = True


def placement(tensor: torch.Tensor) -> dict:
    if isinstance(tensor, DTensor):
        return {
            "type": "DTensor",
            "placements": [str(p) for p in tensor.placements],
            "global": list(tensor.shape),
            "local": list(tensor.to_local().shape),
        }
    return {"type": type(tensor).__name__, "global": list(tensor.shape), "local": list(tensor.shape)}


class ShardingProbe(TrainerCallback):
    """Records where every layer's logits live: between steps, and inside the first training forward."""

    def __init__(self) -> None:
        self.evidence: dict = {"between_steps": {}, "during_forward": {}}
        self.hooks: list = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        mask_model = next(m for m in model.modules() if isinstance(m, MaskModel))
        self.layers = mask_model.masked_layers()
        self.evidence["wrapped"] = type(model).__name__
        for name, layer in self.layers.items():
            self.hooks.append(layer.register_forward_pre_hook(self._pre_forward(name)))

    def _pre_forward(self, name: str):
        def hook(module, inputs):
            if module.training and name not in self.evidence["during_forward"]:
                # this layer's logits as its own forward sees them, and every other layer's at that moment
                self.evidence["during_forward"][name] = {
                    other: placement(layer.mask_logits) for other, layer in self.layers.items()
                }

        return hook

    def on_step_end(self, args, state, control, **kwargs):
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        if state.global_step == 1:
            self.evidence["between_steps"] = {
                name: placement(layer.mask_logits) for name, layer in self.layers.items()
            }


class SaveAtStart(TrainerCallback):
    """Gathers and saves the mask once the model is wrapped, before the first step (the step-0 mask)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.trainer: Trainer | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        save_mask(self.trainer, self.folder)


def save_mask(trainer: Trainer, folder: Path) -> None:
    """The FSDP save recipe: gather the full state dict on every process, then the main process writes."""
    state_dict = trainer.accelerator.get_state_dict(trainer.model)
    if trainer.is_world_process_zero():
        mask_model = next(m for m in trainer.model.modules() if isinstance(m, MaskModel))
        mask_model.save_pretrained(folder, state_dict=state_dict, save_logits=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--ddp", action="store_true")
    parser.add_argument("--optimizer", choices=["adamw", "maskadamw"], default="maskadamw")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--logits-dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=4)
    opts = parser.parse_args()
    fsdp, from_launcher = not opts.ddp, os.environ.get("ACCELERATE_USE_FSDP") == "true"

    model = tiny_llama(seed=0)
    mask_model = get_mask_model(model, MaskConfig(prior="magnitude", logits_dtype=opts.logits_dtype))
    ids = torch.randint(3, 128, (32, 16), generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(
        str(opts.out / "trainer"),
        max_steps=opts.steps,
        per_device_train_batch_size=2,
        learning_rate=opts.lr,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=2,
        seed=0,
        ddp_find_unused_parameters=False,
        **({"fsdp": True, "fsdp_config": dict(FSDP_CONFIG)} if fsdp and not from_launcher else {}),
    )
    probe, at_start = ShardingProbe(), SaveAtStart(opts.out / "mask_step0")
    trainer = Trainer(
        model=mask_model,
        args=args,
        train_dataset=data,
        callbacks=[MaskAnnealCallback(), probe, at_start],
        **(
            {"optimizer_cls_and_kwargs": (MaskAdamW, {"lr": opts.lr})}
            if opts.optimizer == "maskadamw"
            else {}
        ),
    )
    at_start.trainer = trainer
    if fsdp:
        enable_fsdp_on_cpu(trainer)
    trainer.train()
    save_mask(trainer, opts.out / "mask")
    rank = args.process_index
    full = {}
    for name, layer in probe.layers.items():  # all-gathers shard by shard: another path than get_state_dict
        logits = layer.mask_logits.detach()
        full[name] = (logits.full_tensor() if isinstance(logits, DTensor) else logits).contiguous()
    save_file(full, opts.out / f"full{rank}.safetensors")
    probe.evidence["distributed_type"] = str(trainer.accelerator.distributed_type)
    probe.evidence["world_size"] = trainer.accelerator.num_processes
    probe.evidence["log_history"] = trainer.state.log_history
    (opts.out / f"evidence{rank}.json").write_text(json.dumps(probe.evidence, indent=1))
    if rank == 0:
        first = probe.evidence["between_steps"]
        print("sharding of the mask logits (rank 0, between steps):")
        for name, where in list(first.items())[:3]:
            print(f"  {name}: {where}")


if __name__ == "__main__":
    main()

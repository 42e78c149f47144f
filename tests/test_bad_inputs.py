"""The catalogue of bad inputs: each is refused with a specific hf_maskllm error that names the problem and the fix.

One row per bad input in :data:`CASES`: what a user might do wrong (``run``), the exact error class, and
two regular expressions the message must contain, one naming the problem and one naming the fix. A few
inputs need a fixture (the local Hub) or a separate interpreter (a checkpoint opened without hf_maskllm)
and are the tests after the table.
"""

from __future__ import annotations

import json
import re
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import datasets
import pytest
import torch
from models import odd_net, single_thread, tiny_llama, tiny_opt  # noqa: F401  (single_thread: autouse)
from sparse_helpers import merged_model
from test_data import CharTokenizer
from transformers import AutoModelForCausalLM

from hf_maskllm import MaskConfig, MaskModel, check_nm, get_mask_model
from hf_maskllm.adapters.config import CONFIG_NAME
from hf_maskllm.adapters.mask_file import LOGITS_NAME, MASKS_NAME
from hf_maskllm.data import load_texts
from hf_maskllm.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    MaskFileError,
    MaskLLMError,
    NMViolationError,
    TargetError,
)
from hf_maskllm.sparse import save_compressed
from hf_maskllm.sparse.checkpoint import write_checkpoint_file

TOKENIZER = CharTokenizer()


# ---------------------------------------------------------------------------------------------- helpers
def trained_mask(n: int = 2, m: int = 4, seed: int = 3) -> MaskModel:
    """A mask model with random (trained-looking) logits."""
    mm = get_mask_model(tiny_llama(), MaskConfig(n=n, m=m))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in mm.masked_layers().values():
            layer.mask_logits.copy_(torch.randn(layer.mask_logits.shape, generator=generator))
    return mm


def saved_mask(folder: Path, n: int = 2, m: int = 4, save_logits: bool = False) -> Path:
    trained_mask(n, m).save_pretrained(folder, save_logits=save_logits)
    return folder


def load_mask(folder: Path | str, model: torch.nn.Module | None = None) -> MaskModel:
    return MaskModel.from_pretrained(tiny_llama() if model is None else model, folder)


def edited(path: Path, change: Callable[[dict], None]) -> Path:
    """Apply ``change`` to the JSON file ``path``; returns its folder."""
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return path.parent


def flipped(path: Path, key: str | None = None) -> Path:
    """Flip the low bit of a byte in the middle of a tensor's data (the first tensor if ``key`` is None); returns
    the folder."""
    raw = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    key = key or sorted(k for k in header if k != "__metadata__")[0]
    start, end = header[key]["data_offsets"]
    raw[8 + length + (start + end) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    return path.parent


def compressed(folder: Path) -> Path:
    save_compressed(merged_model("llama"), folder)
    return folder


def pickled(path: Path) -> Path:
    """Replace ``path`` by a pickle (what a pickle-based tool leaves; it is never unpickled); returns the folder."""
    torch.save({"weight": torch.zeros(2)}, path)
    return path.parent


def truncated(path: Path, keep: int = -10) -> Path:
    path.write_bytes(path.read_bytes()[:keep])
    return path.parent


def removed(path: Path) -> Path:
    path.unlink()
    return path.parent


def offline_repo(tmp: Path, _) -> None:
    load_mask("user/not-in-the-cache")  # fails fast: timed in test_offline_hub_repo_fails_fast (slow)


# ---------------------------------------------------------------------------------------------- the catalogue
@dataclass(frozen=True)
class Case:
    """A bad input: ``run(tmp_path, request)`` must raise exactly ``error`` with ``problem`` and ``fix`` in it."""

    id: str
    run: Callable[[Path, pytest.FixtureRequest], object]
    error: type[MaskLLMError]
    problem: str
    fix: str


def _nm_file_of_other_config(tmp: Path, _) -> None:
    saved_mask(tmp / "a", 2, 4)
    saved_mask(tmp / "b", 1, 4)
    (tmp / "a" / MASKS_NAME).write_bytes((tmp / "b" / MASKS_NAME).read_bytes())
    load_mask(tmp / "a")


def _nan_logits_save(tmp: Path, _) -> None:
    mm = trained_mask()
    with torch.no_grad():
        next(iter(mm.masked_layers().values())).mask_logits[0, 0] = float("nan")
    mm.save_pretrained(tmp / "m")


def _inf_logits_file(tmp: Path, _) -> None:
    """Logits with an infinity, written by another tool (hf_maskllm's writer refuses them)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = saved_mask(tmp / "m", save_logits=True)
    with safe_open(str(folder / LOGITS_NAME), framework="pt") as f:
        logits, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    logits[sorted(logits)[0]][0, 0] = float("inf")
    save_file(logits, folder / LOGITS_NAME, metadata=metadata)
    load_mask(folder)


def _merge_twice(tmp: Path, _) -> None:
    mm = trained_mask()
    mm.merge_and_unload()
    mm.merge_and_unload()


def _edit_quant(tmp: Path, change: Callable[[dict], None]) -> None:
    AutoModelForCausalLM.from_pretrained(
        edited(compressed(tmp / "c") / "config.json", lambda cfg: change(cfg["quantization_config"]))
    )


def _compressed_with(tmp: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """A checkpoint whose tensors a (buggy) writer changed, with valid checksums: reaches the deeper checks."""
    from safetensors.torch import load_file

    folder = compressed(tmp / "c")
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    write_checkpoint_file(tensors, folder / "model.safetensors")
    AutoModelForCausalLM.from_pretrained(folder)


def _other_architecture_config(tmp: Path, _) -> None:
    AutoModelForCausalLM.from_pretrained(
        edited(compressed(tmp / "c") / "config.json", lambda cfg: cfg.update(num_hidden_layers=3))
    )


def _weights_as_pickle_bin(tmp: Path, _) -> None:
    folder = removed(compressed(tmp / "c") / "model.safetensors")
    AutoModelForCausalLM.from_pretrained(pickled(folder / "pytorch_model.bin"))


def _calibration(source: object, seqlen: int = 512) -> None:
    get_mask_model(
        tiny_llama(),
        MaskConfig(prior="wanda", calibration_samples=1, calibration_seqlen=seqlen),
        calibration_data=source,
        tokenizer=TOKENIZER,
    )


SAVE_AGAIN = r"save (it|the mask|or download it) again|save the checkpoint again|download or save"
CASES = [
    # --- invalid n / m
    Case("n-zero", lambda t, r: MaskConfig(n=0, m=4), ConfigError, r"`n` must be at least 1", r"n=2, m=4"),
    Case("n-equals-m", lambda t, r: MaskConfig(n=4, m=4), ConfigError, r"smaller than `m`", r"n=2, m=4"),
    Case("m-above-8", lambda t, r: MaskConfig(n=2, m=16), ConfigError, r"at most 8", r"n=2, m=4"),
    Case("n-not-an-int", lambda t, r: MaskConfig(n="2"), ConfigError, r"n='2'", r"must be integers"),
    # --- targets
    Case(
        "targets-match-nothing",
        lambda t, r: get_mask_model(tiny_llama(), MaskConfig(target_modules=["no_such_proj"])),
        TargetError,
        r"matched no maskable layer",
        r"Use 'all-linear' or names from model.named_modules",
    ),
    Case(
        "target-not-a-linear",
        lambda t, r: get_mask_model(tiny_llama(), MaskConfig(target_modules=["embed_tokens"])),
        TargetError,
        r"cannot be masked.*Embedding",
        r"Narrow target_modules",
    ),
    Case(
        "strict-input-not-divisible-by-m",
        lambda t, r: get_mask_model(odd_net(), MaskConfig(strict=True)),
        TargetError,
        r"not divisible by m=4: \['odd \(in_features=6\)'\]",
        r"exclude_modules",
    ),
    # --- a mask folder made for something else
    Case(
        "mask-of-other-shapes",
        lambda t, r: load_mask(saved_mask(t / "m"), tiny_llama(hidden=128)),
        MaskFileError,
        r"was saved with shape .* the model's is",
        r"load it into the model it was learned on",
    ),
    Case(
        "mask-of-other-architecture",
        lambda t, r: load_mask(saved_mask(t / "m"), tiny_opt()),
        MaskFileError,
        r"saved for other layers",
        r"Load it into the model .* it was learned on",
    ),
    Case(
        "mask-file-of-other-nm",
        _nm_file_of_other_config,
        MaskFileError,
        r"holds 1:4 masks but 2:4",
        r"n=1, m=4",
    ),
    Case(
        "prior-of-other-nm",
        lambda t, r: get_mask_model(tiny_llama(), MaskConfig(n=1, m=4, prior=str(saved_mask(t / "m")))),
        MaskFileError,
        r"is 2:4 but the config asks for 1:4",
        r"use the same N:M",
    ),
    # --- damaged mask files
    Case(
        "mask-safetensors-truncated",
        lambda t, r: load_mask(truncated(saved_mask(t / "m") / MASKS_NAME)),
        MaskFileError,
        r"corrupt or truncated",
        SAVE_AGAIN,
    ),
    Case(
        "mask-safetensors-bit-flip",
        lambda t, r: load_mask(flipped(saved_mask(t / "m") / MASKS_NAME)),
        MaskFileError,
        r"fails its checksum",
        SAVE_AGAIN,
    ),
    Case(
        "mask-folder-lacks-masks",
        lambda t, r: load_mask(removed(saved_mask(t / "m") / MASKS_NAME)),
        MaskFileError,
        rf"lacks \['{MASKS_NAME}'\]",
        r"Save it again with save_pretrained",
    ),
    Case(
        "logits-disagree-with-masks",
        lambda t, r: (
            saved_mask(t / "a", save_logits=True),
            trained_mask(seed=9).save_pretrained(t / "b", save_logits=True),
            (t / "a" / LOGITS_NAME).write_bytes((t / "b" / LOGITS_NAME).read_bytes()),
            load_mask(t / "a"),
        ),
        MaskFileError,
        r"disagree with the saved hard masks",
        SAVE_AGAIN,
    ),
    # --- mask_config.json
    Case(
        "config-json-missing-field",
        lambda t, r: load_mask(edited(saved_mask(t / "m") / CONFIG_NAME, lambda d: d.pop("tau"))),
        MaskFileError,
        r"missing field\(s\) \['tau'\]",
        SAVE_AGAIN,
    ),
    Case(
        "config-json-unknown-field",
        lambda t, r: load_mask(edited(saved_mask(t / "m") / CONFIG_NAME, lambda d: d.update(temp=1))),
        MaskFileError,
        r"Unknown MaskConfig field\(s\) \['temp'\]",
        r"Fix mask_config.json, or save the mask again",
    ),
    Case(
        "config-json-wrong-type",
        lambda t, r: load_mask(edited(saved_mask(t / "m") / CONFIG_NAME, lambda d: d.update(n="two"))),
        MaskFileError,
        r"must be integers, got n='two'",
        r"Fix mask_config.json, or save the mask again",
    ),
    Case(
        "config-json-not-json",
        lambda t, r: load_mask(truncated(saved_mask(t / "m") / CONFIG_NAME, 20)),
        MaskFileError,
        r"is not valid JSON",
        SAVE_AGAIN,
    ),
    # --- future format versions
    Case(
        "mask-future-format-version",
        lambda t, r: load_mask(
            edited(saved_mask(t / "m") / CONFIG_NAME, lambda d: d.update(format_version=2))
        ),
        MaskFileError,
        r"mask format version 2, newer than",
        r"pip install -U hf_maskllm",
    ),
    Case(
        "checkpoint-future-format-version",
        lambda t, r: _edit_quant(t, lambda q: q.update(format_version=3)),
        CheckpointError,
        r"format version 3",
        r"Upgrade hf_maskllm \(`pip install -U hf_maskllm`\)",
    ),
    # --- NaN / inf
    Case("nan-logits-save", _nan_logits_save, MaskLLMError, r"contain NaN or inf", r"lower learning rate"),
    Case(
        "inf-logits-file",
        _inf_logits_file,
        MaskFileError,
        r"not finite floats",
        r"Delete it|save the mask again",
    ),
    Case(
        "checkpoint-nan-values",
        lambda t, r: _compressed_with(
            t, lambda w: w["model.layers.1.self_attn.q_proj.values"].view(-1).__setitem__(3, float("nan"))
        ),
        CheckpointError,
        r"q_proj.values holds NaN or inf",
        SAVE_AGAIN,
    ),
    # --- pickles instead of safetensors
    Case(
        "pickle-as-mask-file",
        lambda t, r: load_mask(pickled(saved_mask(t / "m") / MASKS_NAME)),
        MaskFileError,
        r"is a pickle / torch.save file, which hf_maskllm never loads",
        r"Convert it to safetensors",
    ),
    Case(
        "pickle-as-checkpoint-weights",
        lambda t, r: AutoModelForCausalLM.from_pretrained(pickled(compressed(t / "c") / "model.safetensors")),
        CheckpointError,
        r"is a pickle / torch.save file",
        r"Convert it to safetensors",
    ),
    Case(
        "pickle-bin-as-checkpoint-weights",
        _weights_as_pickle_bin,
        CheckpointError,
        r"pytorch_model.bin is not a safetensors file",
        r"Save the checkpoint again with save_compressed",
    ),
    # --- damaged or mismatched compressed checkpoints
    Case(
        "checkpoint-truncated",
        lambda t, r: AutoModelForCausalLM.from_pretrained(
            truncated(compressed(t / "c") / "model.safetensors")
        ),
        CheckpointError,
        r"corrupt or truncated",
        SAVE_AGAIN,
    ),
    Case(
        "checkpoint-bit-flip",
        lambda t, r: AutoModelForCausalLM.from_pretrained(
            flipped(compressed(t / "c") / "model.safetensors", "model.layers.0.mlp.up_proj.values")
        ),
        CheckpointError,
        r"\['model.layers.0.mlp.up_proj.values'\] fail their checksum",
        SAVE_AGAIN,
    ),
    Case(
        "checkpoint-duplicate-positions",
        lambda t, r: _compressed_with(
            t, lambda w: w["model.layers.0.mlp.down_proj.meta"].__setitem__((0, 0), 0)
        ),
        CheckpointError,
        r"down_proj.*not strictly increasing",
        r"Save it again with hf_maskllm.sparse.save_compressed",
    ),
    Case(
        "checkpoint-missing-tensor",
        lambda t, r: _compressed_with(t, lambda w: w.pop("model.layers.0.mlp.down_proj.meta")),
        CheckpointError,
        r"lacks 1 tensor\(s\).*down_proj.meta",
        r"download or save the checkpoint again",
    ),
    Case(
        "checkpoint-config-of-other-architecture",
        _other_architecture_config,
        CheckpointError,
        r"lists module 'model.layers.2|lacks .* tensor",
        r"config.json is corrupt or was edited; download or save|the model class it was saved from",
    ),
    Case(
        "checkpoint-wrong-nm-metadata",
        lambda t, r: _edit_quant(t, lambda q: q.update(n=1)),
        CheckpointError,
        r"do not fit this LlamaForCausalLM",
        r"download or save the checkpoint again",
    ),
    Case(
        "checkpoint-invalid-nm-metadata",
        lambda t, r: _edit_quant(t, lambda q: q.update(m=16)),
        CheckpointError,
        r"quantization_config: .*m=16",
        r"download or save the checkpoint again",
    ),
    Case(
        "save-compressed-not-nm",
        lambda t, r: save_compressed(tiny_llama(), t / "c", modules=["model.layers.0.mlp.up_proj"]),
        NMViolationError,
        r"up_proj' is not 2:4 sparse",
        r"merge the mask into the weights first",
    ),
    # --- the Hub, offline (the test suite runs with HF_HUB_OFFLINE=1)
    Case(
        "hub-repo-offline",
        offline_repo,
        MaskFileError,
        r"not in the Hub cache.*HF_HUB_OFFLINE",
        r"Pass a local folder or go online",
    ),
    Case(
        "path-that-does-not-exist",
        lambda t, r: load_mask(t / "no" / "such" / "mask"),
        MaskFileError,
        r"neither an existing folder nor a Hub repo id",
        r"check the path",
    ),
    # --- data
    Case(
        "calibration-text-shorter-than-one-window",
        lambda t, r: _calibration(["only a few characters"], seqlen=512),
        DataError,
        r"fewer than one window of seqlen=512",
        r"pass more text or a smaller seqlen",
    ),
    Case(
        "empty-dataset",
        lambda t, r: _calibration(datasets.Dataset.from_dict({"text": []})),
        DataError,
        r"holds no text",
        r"pass a non-empty source",
    ),
    Case(
        "data-file-of-unsupported-kind",
        lambda t, r: load_texts((t / "data.csv", (t / "data.csv").write_text("text\nhello"))[0]),
        DataError,
        r"Unsupported data file",
        r"use \['.json', '.jsonl', '.parquet', '.txt'\] files",
    ),
    # --- misuse
    Case(
        "merging-twice",
        _merge_twice,
        MaskLLMError,
        r"already called",
        r"Use the model merge_and_unload\(\) returned",
    ),
    Case(
        "check-nm-before-merging",
        lambda t, r: check_nm(trained_mask()),
        MaskLLMError,
        r"needs a merged model",
        r"call mask_model.merge_and_unload\(\) first",
    ),
    Case(
        "prior-without-calibration-data",
        lambda t, r: get_mask_model(tiny_llama(), MaskConfig(prior="sparsegpt")),
        ConfigError,
        r"needs calibration data",
        r"pass calibration_data=",
    ),
]


def test_the_catalogue_covers_at_least_25_distinct_bad_inputs():
    assert len({case.id for case in CASES}) == len(CASES) >= 25


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_raises_a_clear_error(case, tmp_path, request):
    with pytest.raises(MaskLLMError) as info:
        case.run(tmp_path, request)
    assert type(info.value) is case.error, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert re.search(case.problem, message, re.IGNORECASE | re.DOTALL), f"problem not named: {message}"
    assert re.search(case.fix, message, re.IGNORECASE | re.DOTALL), f"fix not named: {message}"


# ---------------------------------------------------------------------------------------------- needing a fixture
def test_hub_repo_that_does_not_exist(local_hub):
    with pytest.raises(MaskFileError) as info:
        load_mask("user/no-such-mask")
    assert re.search(r"no Hub repo of that id exists", str(info.value))
    assert re.search(r"check the path or id, and your HF_TOKEN", str(info.value))


def half_a_mask(tmp_path: Path) -> str:
    """A Hub repo that exists but holds no mask weights (e.g. an interrupted upload): its id."""
    from huggingface_hub import HfApi

    folder = saved_mask(tmp_path / "m")
    api = HfApi()
    api.create_repo("user/half-a-mask")
    api.upload_file(
        path_or_fileobj=folder / CONFIG_NAME, path_in_repo=CONFIG_NAME, repo_id="user/half-a-mask"
    )
    return "user/half-a-mask"


def test_hub_file_that_does_not_exist(local_hub, tmp_path):
    """A repo that exists but holds no mask weights (e.g. an interrupted upload)."""
    with pytest.raises(MaskFileError) as info:
        load_mask(half_a_mask(tmp_path))
    assert re.search(rf"Hub repo 'user/half-a-mask' lacks \['{MASKS_NAME}'\]", str(info.value))
    assert re.search(r"push the mask again", str(info.value))


# ---------------------------------------------------------------------------------------------- timed (slow only)
@pytest.mark.slow
def test_offline_hub_repo_fails_fast():
    """Timed, so slow-only: with HF_HUB_OFFLINE=1 no network attempt hides behind the error."""
    start = time.perf_counter()
    with pytest.raises(MaskFileError):
        load_mask("user/not-in-the-cache")
    assert time.perf_counter() - start < 5.0, "offline Hub lookup must fail fast"


@pytest.mark.slow
def test_hub_repo_that_does_not_exist_fails_fast(local_hub):
    start = time.perf_counter()
    with pytest.raises(MaskFileError):
        load_mask("user/no-such-mask")
    assert time.perf_counter() - start < 5.0


@pytest.mark.slow
def test_hub_file_that_does_not_exist_fails_fast(local_hub, tmp_path):
    repo_id = half_a_mask(tmp_path)
    start = time.perf_counter()
    with pytest.raises(MaskFileError):
        load_mask(repo_id)
    assert time.perf_counter() - start < 5.0

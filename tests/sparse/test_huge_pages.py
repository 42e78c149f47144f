"""A loaded compressed model's CPU weights leave the safetensors file mapping for one anonymous mapping
advised for huge pages: same values, dtypes, parameter flags and ties; nothing keeps the file mapped;
the model still generates, re-saves bit for bit and trains; ``HF_MASKLLM_HUGE_PAGES=0`` keeps the mapping;
views and parameter subclasses are left alone."""

from __future__ import annotations

import gc
import mmap
import re
from pathlib import Path

import pytest
import torch
from models import single_thread  # noqa: F401  (autouse fixture)
from safetensors.torch import load_file
from sparse_helpers import VOCAB, merged_model
from transformers import AutoModelForCausalLM

import hf_maskllm.sparse  # noqa: F401  (registers the loader)
from hf_maskllm.sparse import save_compressed
from hf_maskllm.sparse.huge_pages import (
    _copy_releasing,
    _file_page_releaser,
    huge_pages_available,
    to_huge_pages,
)

needs_thp = pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages on this system")


def _mappings() -> list[tuple[int, int, str]]:
    """``(start, end, backing file or "")`` of this process's memory mappings."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(v, 16) for v in fields[0].split("-"))
        out.append((start, end, fields[5] if len(fields) > 5 else ""))
    return out


def _backing(t: torch.Tensor, maps: list[tuple[int, int, str]]) -> str:
    return next(name for start, end, name in maps if start <= t.data_ptr() < end)


def _weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    )


def _ids(seed: int, n: int = 6) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


@needs_thp
@pytest.mark.parametrize(
    "kind, save_kwargs",
    [
        ("llama", {}),  # tied embedding, float kept values
        ("llama", {"values": "int4", "group_size": 16, "embedding": "int8"}),
        ("qwen2", {"values": "int8", "group_size": 16, "embedding": "int8"}),  # untied
    ],
)
def test_loaded_weights_leave_the_file_for_huge_pages_with_the_same_values_and_ties(
    kind, save_kwargs, tmp_path
):
    folder = tmp_path / "c"
    save_compressed(merged_model(kind), folder, **save_kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(folder)

    gc.collect()
    maps = _mappings()
    assert not any(name.startswith(str(folder)) for _, _, name in maps)  # nothing keeps the file mapped
    weights = _weights(loaded)
    assert weights
    for name, t in weights:
        assert _backing(t, maps) == "", name  # anonymous memory
        assert t.data_ptr() % 64 == 0, name

    stored = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
    # the values are the stored ones (every stored tensor is some weight of the model, bit for bit)
    by_name = dict(weights)
    for key, value in stored.items():
        if key in by_name:
            assert torch.equal(by_name[key].view(torch.uint8), value.view(torch.uint8)), key
    # ties and parameter flags
    if kind == "llama" and not save_kwargs:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert all(isinstance(p, torch.nn.Parameter) for _, p in loaded.named_parameters())

    # it still runs, re-saves the same bytes and generates the same tokens as a model on the file mapping
    with torch.no_grad():
        logits = loaded(_ids(1)).logits
    assert torch.isfinite(logits).all()
    loaded.save_pretrained(tmp_path / "again")
    again = {
        k: v for f in sorted((tmp_path / "again").glob("*.safetensors")) for k, v in load_file(f).items()
    }
    assert again.keys() == stored.keys()
    for key in stored:
        assert torch.equal(again[key].view(torch.uint8), stored[key].view(torch.uint8)), key


@needs_thp
def test_the_mapping_is_advised_for_huge_pages_and_starts_on_a_huge_page(tmp_path):
    save_compressed(merged_model("llama"), tmp_path / "c", values="int8", group_size=16)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    first = min(t.data_ptr() for _, t in _weights(loaded))
    assert first % (2 << 20) == 0
    flags, inside = None, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        header = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if header:
            inside = int(header[1], 16) <= first < int(header[2], 16)
        elif inside and line.startswith("VmFlags:"):
            flags = line.split()[1:]
    assert flags is not None and "hg" in flags  # MADV_HUGEPAGE


def test_hf_maskllm_huge_pages_0_keeps_the_file_mapping(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_MASKLLM_HUGE_PAGES", "0")
    assert not huge_pages_available()
    save_compressed(merged_model("llama"), tmp_path / "c", values="int8", group_size=16)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    maps = _mappings()
    qvalues = loaded.model.layers[0].mlp.up_proj.qvalues
    assert _backing(qvalues, maps).endswith(".safetensors")
    assert to_huge_pages(loaded) == 0


@needs_thp
def test_views_subclasses_and_other_tensors_stay_and_training_still_works():
    model = merged_model("llama")
    flat = torch.arange(64, dtype=torch.float32)
    model.register_buffer("whole", flat)
    model.register_buffer("part", flat[8:24])  # overlaps "whole": both stay
    model.register_buffer("strided", torch.arange(32, dtype=torch.float32)[::2])  # not contiguous: stays
    emb = model.model.embed_tokens.weight
    before = {name: t.detach().clone() for name, t in _weights(model)}
    moved = to_huge_pages(model)
    assert moved >= sum(p.nbytes for p in model.parameters())
    assert model.whole.data_ptr() == flat.data_ptr() and model.part.data_ptr() == flat[8:].data_ptr()
    assert not model.strided.is_contiguous()
    assert model.model.embed_tokens.weight is not emb  # a new Parameter ...
    assert model.lm_head.weight is model.model.embed_tokens.weight  # ... still tied
    for name, t in _weights(model):
        assert torch.equal(t, before[name]), name
    # a training step on the moved parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(_ids(2), labels=_ids(2)).loss
    loss.backward()
    opt.step()
    assert not torch.equal(model.model.norm.weight, before["model.norm.weight"])


@needs_thp
def test_a_cpu_device_map_moves_the_weights_too(tmp_path):
    save_compressed(merged_model("llama"), tmp_path / "c", values="int8", group_size=16)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "c", device_map="cpu")
    gc.collect()
    maps = _mappings()
    assert not any(name.startswith(str(tmp_path / "c")) for _, _, name in maps)
    assert all(_backing(t, maps) == "" for _, t in _weights(loaded))


def _mapping_rss_kb(address: int) -> int:
    """Resident kB of the mapping that holds ``address`` (``/proc/self/smaps``)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        header = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if header:
            inside = int(header[1], 16) <= address < int(header[2], 16)
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1])
    raise AssertionError("no mapping holds the address")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc")
def test_copied_file_pages_leave_the_process_and_anonymous_memory_is_never_released(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(bytes(range(256)) * 4096 * 4)  # 4 MiB
    with open(path, "rb") as f:
        region = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    mapped = torch.frombuffer(region, dtype=torch.uint8)
    assert int(mapped.sum()) > 0  # every page resident
    resident = _mapping_rss_kb(mapped.data_ptr())
    anonymous = torch.arange(1 << 20, dtype=torch.int32)
    release = _file_page_releaser()
    release(mapped.data_ptr(), mapped.nbytes)
    release(anonymous.data_ptr(), anonymous.nbytes)  # not a file's pages: left alone
    assert _mapping_rss_kb(mapped.data_ptr()) < resident / 4
    assert torch.equal(anonymous, torch.arange(1 << 20, dtype=torch.int32))
    assert torch.equal(
        mapped[:512], torch.arange(256, dtype=torch.uint8).repeat(2)
    )  # read from the file again


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc")
def test_a_large_tensor_is_copied_in_pieces_whose_file_pages_leave_as_it_goes(tmp_path):
    """A tensor larger than one piece (a tied embedding) is never resident twice: each copied piece's file pages
    are released before the next piece is copied, and the copy is exact."""
    path = tmp_path / "blob"
    values = torch.randn(5 << 20, generator=torch.Generator().manual_seed(0))  # 20 MiB of float32
    path.write_bytes(values.numpy().tobytes())
    with open(path, "rb") as f:
        region = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    mapped = torch.frombuffer(region, dtype=torch.float32)
    assert torch.equal(mapped, values)  # every page resident
    release, resident_after = _file_page_releaser(), []

    def recording_release(address: int, nbytes: int) -> None:
        release(address, nbytes)
        resident_after.append(_mapping_rss_kb(mapped.data_ptr()))

    copy = torch.empty_like(values)
    _copy_releasing(copy, mapped, recording_release)
    assert torch.equal(copy, values)
    assert len(resident_after) == 4  # three pieces of at most 8 MiB, then the whole range
    assert resident_after[0] <= 13 * 1024 and resident_after[1] <= 5 * 1024 and resident_after[-1] < 256
    assert torch.equal(mapped[:1000], values[:1000])  # read from the file again

"""Reading safetensors files (truncated -> corrupt with its cause; PermissionError and MemoryError pass
through), and resolve_folder: only Hub errors read as download failures, not the disk's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from hf_maskllm.adapters.config import CONFIG_NAME
from hf_maskllm.errors import MaskFileError
from hf_maskllm.serialization import (
    load_safetensors,
    resolve_folder,
    save_safetensors,
    tensor_checksums,
    verify_safetensors,
)


# ---------------------------------------------------------------------------------------------- other read errors
def _small_file(tmp_path: Path) -> Path:
    path, tensors = tmp_path / "t.safetensors", {"a": torch.arange(4.0)}
    save_safetensors(tensors, path, metadata={"crc": json.dumps(tensor_checksums(tensors))})
    return path


def _read_both(path: Path) -> None:
    load_safetensors(path, MaskFileError)
    verify_safetensors(path, "crc", MaskFileError)


def test_a_truncated_file_reads_as_corrupt_with_its_cause(tmp_path):
    from safetensors import SafetensorError

    path = _small_file(tmp_path)
    path.write_bytes(path.read_bytes()[:-3])
    for read in (load_safetensors, lambda p, e: verify_safetensors(p, "crc", e)):
        with pytest.raises(MaskFileError, match="corrupt or truncated") as info:
            read(path, MaskFileError)
        assert isinstance(info.value.__cause__, SafetensorError)


@pytest.mark.parametrize("how", ["chmod", "safe_open"])
def test_a_file_that_cannot_be_opened_raises_permission_error(tmp_path, monkeypatch, how):
    import safetensors

    path = _small_file(tmp_path)
    if how == "chmod":
        if os.geteuid() == 0:
            pytest.skip("root reads any file; the safe_open case covers this")
        path.chmod(0)
    else:

        def denied(*args, **kwargs):
            raise PermissionError(13, "Permission denied", str(path))

        monkeypatch.setattr(safetensors, "safe_open", denied)
    try:
        with pytest.raises(PermissionError):
            load_safetensors(path, MaskFileError)
        with pytest.raises(PermissionError):
            verify_safetensors(path, "crc", MaskFileError)
    finally:
        path.chmod(0o644)


def test_running_out_of_memory_while_reading_raises_memory_error(tmp_path, monkeypatch):
    import mmap

    import safetensors

    path = _small_file(tmp_path)
    _read_both(path)  # the file is fine

    def out_of_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(mmap, "mmap", out_of_memory)  # verify_safetensors maps the file itself
    with pytest.raises(MemoryError):
        verify_safetensors(path, "crc", MaskFileError)
    monkeypatch.setattr(safetensors, "safe_open", out_of_memory)
    with pytest.raises(MemoryError):
        load_safetensors(path, MaskFileError)


# ---------------------------------------------------------------------------------------------- resolve_folder
def test_only_hub_errors_read_as_download_failures(monkeypatch):
    import huggingface_hub

    def fails_with(error: BaseException):
        def download(*args, **kwargs):
            raise error

        return download

    reset = ConnectionResetError(104, "Connection reset by peer")  # the network
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fails_with(reset))
    with pytest.raises(MaskFileError, match="Could not download 'user/mask'.*check the network") as info:
        resolve_folder("user/mask", [CONFIG_NAME], error=MaskFileError)
    assert info.value.__cause__ is reset
    cache_denied = PermissionError(13, "Permission denied", "/hf-cache")  # the disk, not the Hub
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fails_with(cache_denied))
    with pytest.raises(PermissionError):
        resolve_folder("user/mask", [CONFIG_NAME], error=MaskFileError)


@pytest.mark.parametrize("header_bytes", [0x280, 0x380, 0x480, 0x580])
def test_a_safetensors_header_length_that_starts_like_a_pickle_still_loads(tmp_path, header_bytes):
    """The first bytes of a safetensors file are its header's length: 640 is b"\\x80\\x02...", a pickle's
    opening. Such a file is read, not refused as a pickle."""
    tensors = {"a": torch.arange(4.0)}
    for pad in range(2000):
        path = tmp_path / "t.safetensors"
        save_safetensors(tensors, path, metadata={"pad": "x" * pad})
        if int.from_bytes(path.read_bytes()[:8], "little") == header_bytes:
            break
    else:
        pytest.fail(f"no padding gives a {header_bytes}-byte header")
    loaded, metadata = load_safetensors(path, error=MaskFileError, what="test file")
    assert torch.equal(loaded["a"], tensors["a"]) and metadata["pad"].startswith("x")

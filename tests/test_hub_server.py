"""The local Hub server: huggingface_hub and transformers push and pull through it, errors come fast and typed."""

import json
import time
from pathlib import Path

import pytest
import torch
from hub_server import serve_local_hub
from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError
from safetensors.torch import save_file


def _make_folder(folder: Path) -> dict[str, bytes]:
    folder.mkdir()
    (folder / "sub").mkdir()
    (folder / "config.json").write_text(json.dumps({"n": 2, "m": 4}))
    save_file(
        {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)},
        str(folder / "sub" / "weights.safetensors"),
    )
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_upload_folder_then_download(local_hub, tmp_path):
    expected = _make_folder(tmp_path / "src")
    api = HfApi()
    url = api.create_repo("user/demo")
    assert url.repo_id == "user/demo"
    api.create_repo("user/demo", exist_ok=True)  # 409 from the server, swallowed by the client
    info = api.upload_folder(repo_id="user/demo", folder_path=tmp_path / "src", commit_message="add files")
    assert local_hub.repo_files("user/demo") == expected
    assert local_hub.commits("user/demo")[0] == info.oid
    assert not any("lfs" in path or "xet" in path for _, path in local_hub.requests)

    model_info = api.model_info("user/demo")
    assert model_info.sha == info.oid
    assert sorted(s.rfilename for s in model_info.siblings) == sorted(expected)
    assert sorted(api.list_repo_files("user/demo")) == sorted(expected)

    snapshot = Path(snapshot_download("user/demo"))
    assert snapshot.parent.name == "snapshots" and snapshot.name == info.oid
    assert str(snapshot).startswith(str(local_hub.cache_dir))
    assert {p: (snapshot / p).read_bytes() for p in expected} == expected
    single = hf_hub_download("user/demo", "sub/weights.safetensors", cache_dir=tmp_path / "other-cache")
    assert Path(single).read_bytes() == expected["sub/weights.safetensors"]

    # A second commit moves main; the first commit stays downloadable by its sha.
    api.upload_file(path_or_fileobj=b'{"n": 1}', path_in_repo="config.json", repo_id="user/demo")
    api.delete_file("sub/weights.safetensors", repo_id="user/demo")
    assert local_hub.repo_files("user/demo") == {"config.json": b'{"n": 1}'}
    assert len(local_hub.commits("user/demo")) == 4  # initial, upload_folder, upload_file, delete_file
    old = hf_hub_download("user/demo", "config.json", revision=info.oid, cache_dir=tmp_path / "c3")
    assert Path(old).read_bytes() == expected["config.json"]
    assert (
        Path(hf_hub_download("user/demo", "config.json", cache_dir=tmp_path / "c3")).read_bytes()
        == b'{"n": 1}'
    )


def test_transformers_push_to_hub_then_from_pretrained(local_hub):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    model = LlamaForCausalLM(config).eval()
    model.push_to_hub("user/tiny")
    assert {"config.json", "model.safetensors"} <= set(local_hub.repo_files("user/tiny"))

    reloaded = AutoModelForCausalLM.from_pretrained("user/tiny").eval()
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def _missing_repo_and_file(local_hub) -> None:
    local_hub.create_repo("user/empty")
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("user/does-not-exist")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("user/does-not-exist", "config.json")
    with pytest.raises(EntryNotFoundError):
        hf_hub_download("user/empty", "config.json")


def _offline_lookup(tmp_path) -> None:
    assert constants.is_offline_mode(), (
        "conftest.py should set HF_HUB_OFFLINE=1 before huggingface_hub is imported"
    )
    with pytest.raises(LocalEntryNotFoundError):
        snapshot_download("user/whatever", cache_dir=tmp_path)


def test_missing_repo_and_missing_file_raise_their_own_errors(local_hub):
    _missing_repo_and_file(local_hub)


def test_offline_without_fixture_raises_local_entry_not_found(tmp_path):
    _offline_lookup(tmp_path)


@pytest.mark.slow
def test_missing_repo_and_missing_file_fail_within_two_seconds(local_hub):
    """Timed, so slow-only: no retry or back-off hides behind the errors."""
    start = time.perf_counter()
    _missing_repo_and_file(local_hub)
    assert time.perf_counter() - start < 2.0


@pytest.mark.slow
def test_offline_lookup_fails_within_two_seconds(tmp_path):
    start = time.perf_counter()
    _offline_lookup(tmp_path)
    assert time.perf_counter() - start < 2.0


def test_serve_local_hub_restores_everything(tmp_path):
    import huggingface_hub.hf_api

    before = (
        constants.ENDPOINT,
        constants.HF_HUB_CACHE,
        constants.HF_HUB_OFFLINE,
        huggingface_hub.hf_api.api.endpoint,
    )
    with serve_local_hub(tmp_path) as hub:
        assert constants.ENDPOINT == hub.endpoint and not constants.is_offline_mode()
        HfApi().create_repo("user/x")
        assert hub.repo_exists("user/x")
    after = (
        constants.ENDPOINT,
        constants.HF_HUB_CACHE,
        constants.HF_HUB_OFFLINE,
        huggingface_hub.hf_api.api.endpoint,
    )
    assert after == before
    with pytest.raises(LocalEntryNotFoundError):
        snapshot_download("user/x", cache_dir=tmp_path / "cache")

"""The Hub: push_to_hub and loading a mask (or a prior) by repo id, a missing repo and offline mode, and the one
rule that tells a repo id from a local path."""

from __future__ import annotations

import time

import pytest
import torch
from mask_states import assert_same_masks, trained_like
from models import single_thread, tiny_llama  # noqa: F401  (single_thread is an autouse fixture)

from hf_maskllm import MaskConfig, MaskModel, get_mask_model
from hf_maskllm.adapters.config import CONFIG_NAME
from hf_maskllm.adapters.mask_file import LOGITS_NAME, MASKS_NAME
from hf_maskllm.errors import ConfigError, MaskFileError
from hf_maskllm.hub import is_hub_repo_id
from hf_maskllm.serialization import resolve_folder


# ---------------------------------------------------------------------------------------------- the Hub
def test_push_to_hub_then_load_by_repo_id(local_hub):
    mm = trained_like(n=2, m=4)
    mm.push_to_hub("user/tiny-mask")
    files = local_hub.repo_files("user/tiny-mask")
    assert {CONFIG_NAME, MASKS_NAME, "README.md"} <= set(files)
    loaded = MaskModel.from_pretrained(tiny_llama(seed=1), "user/tiny-mask")
    assert_same_masks(loaded.hard_masks(), mm.hard_masks())
    # and as a transfer prior by repo id
    prior = get_mask_model(tiny_llama(), MaskConfig(prior="user/tiny-mask", seed=5))
    assert_same_masks(prior.hard_masks(), mm.hard_masks())


def test_push_with_logits(local_hub):
    mm = trained_like(n=1, m=4)
    mm.push_to_hub("user/with-logits", save_logits=True)
    assert LOGITS_NAME in local_hub.repo_files("user/with-logits")
    loaded = MaskModel.from_pretrained(tiny_llama(), "user/with-logits", is_trainable=True)
    for name, layer in loaded.masked_layers().items():
        assert torch.equal(layer.mask_logits.detach(), mm.masked_layers()[name].mask_logits.detach())


def _load_a_missing_repo() -> None:
    with pytest.raises(MaskFileError, match="no Hub repo of that id exists"):
        MaskModel.from_pretrained(tiny_llama(), "user/no-such-mask")
    with pytest.raises(MaskFileError):
        MaskConfig.from_pretrained("user/no-such-mask")


def test_missing_repo_raises(local_hub):
    _load_a_missing_repo()


def _load_offline() -> None:
    with pytest.raises(MaskFileError, match="Hub"):
        MaskModel.from_pretrained(tiny_llama(), "user/not-cached")


def test_repo_id_offline_raises():
    _load_offline()


@pytest.mark.parametrize(
    "name,is_repo",
    [
        ("user/tiny-mask", True),
        ("Org_1/model.v2-x", True),
        ("gpt2", False),  # no owner: a mistyped folder or method name, not a repo hf_maskllm wrote
        ("user/a/b", False),
        ("/abs/path", False),
        ("~/mask", False),
        ("./mask", False),
        ("user/../mask", False),
        ("user/mask--x", False),
        ("user/mask.git", False),
        ("user/", False),
        ("user/has space", False),
        ("", False),
    ],
)
def test_one_rule_says_what_a_hub_repo_id_is(name, is_repo):
    assert is_hub_repo_id(name) is is_repo


def test_an_existing_local_path_is_never_a_repo_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_repo_id("user/mask")
    (tmp_path / "user" / "mask").mkdir(parents=True)
    assert not is_hub_repo_id("user/mask")


def test_loaders_and_config_apply_the_repo_id_rule(tmp_path):
    with pytest.raises(MaskFileError, match="neither an existing folder nor a Hub repo id"):
        resolve_folder("gpt2", [CONFIG_NAME], error=MaskFileError)  # not looked up on the Hub
    MaskConfig(prior="user/tiny-mask").check_prior_source()  # a repo id: fetched when the prior is built
    for bad in ("user/a/b", "not-a-method"):
        with pytest.raises(ConfigError, match="not a one-shot method"):
            MaskConfig(prior=bad).check_prior_source()


# ---------------------------------------------------------------------------------------------- timed (slow only)
@pytest.mark.slow
def test_missing_repo_fails_fast(local_hub):
    """Timed, so slow-only: no retry or back-off hides behind the errors."""
    start = time.perf_counter()
    _load_a_missing_repo()
    assert time.perf_counter() - start < 5.0


@pytest.mark.slow
def test_repo_id_offline_fails_fast():
    start = time.perf_counter()
    _load_offline()
    assert time.perf_counter() - start < 5.0

"""MaskConfig: defaults, candidates, validation (the prior named with a close match) and the mask_config.json
round trip."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from models import single_thread, tiny_llama  # noqa: F401  (single_thread: autouse)

from hf_maskllm import MaskConfig, get_mask_model
from hf_maskllm.adapters.config import CONFIG_NAME, FORMAT_VERSION
from hf_maskllm.errors import ConfigError, MaskFileError
from hf_maskllm.patterns import candidate_patterns

NM_PAIRS = [(n, m) for m in range(2, 9) for n in range(1, m)]


def test_defaults_follow_the_paper_but_for_the_temperature_start_the_logit_scale_end_and_the_prior_strength():
    cfg = MaskConfig()
    assert (cfg.n, cfg.m) == (2, 4)
    assert cfg.target_modules == "all-linear" and cfg.exclude_modules is None
    assert cfg.tau == (2.0, 0.05) and cfg.kappa == (100.0, 1000.0)  # the paper's: (4.0, 0.05), (100.0, 500.0)
    assert cfg.tau_schedule == "linear" and cfg.kappa_schedule == "linear"
    assert cfg.hard is False and cfg.prior is None
    assert cfg.prior_strength == 4.0  # the paper's: 3.0
    assert (
        cfg.wanda_strength is None
    )  # 4.0 with a prior and calibration data, filled in when the mask is added
    assert cfg.sparse_reg == 1e-5 and cfg.init_std == 0.01
    assert cfg.logits_dtype == "bfloat16" and cfg.seed == 0 and cfg.strict is False


def test_candidates_2_4_in_reference_order():
    expected = ["1100", "1010", "1001", "0110", "0101", "0011"]
    got = ["".join(str(int(v)) for v in row) for row in candidate_patterns(2, 4)]
    assert got == expected
    assert MaskConfig().num_candidates == 6


@pytest.mark.parametrize(("n", "m"), NM_PAIRS)
def test_every_nm_up_to_8_is_valid_with_combinations_order(n, m):
    cfg = MaskConfig(n=n, m=m)
    assert cfg.num_candidates == math.comb(m, n)
    cand = candidate_patterns(n, m)
    assert cand.shape == (math.comb(m, n), m)
    expected = torch.zeros(math.comb(m, n), m)
    for row, keep in enumerate(itertools.combinations(range(m), n)):
        expected[row, list(keep)] = 1.0
    assert torch.equal(cand, expected)


# ---------------------------------------------------------------------------------------------- validation
BAD_VALUES = [
    ({"n": 4, "m": 4}, "`n`"),
    ({"n": 2, "m": 9}, "`m`"),
    ({"n": 0, "m": 4}, "`n`"),
    ({"n": 2.0}, "`n`"),
    ({"m": True}, "`m`"),
    ({"tau": (-1.0, 0.05)}, "`tau`"),
    ({"tau": (4.0, float("nan"))}, "`tau`"),
    ({"tau": (4.0, 1.0, 0.05)}, "`tau`"),
    ({"tau": (4.0, float("inf"))}, "`tau`"),
    ({"tau": 4.0}, "`tau`"),
    ({"kappa": (0.0, 500.0)}, "`kappa`"),
    ({"kappa": ("100", "500")}, "`kappa`"),
    ({"tau_schedule": "step"}, "`tau_schedule`"),
    ({"kappa_schedule": "Linear"}, "`kappa_schedule`"),
    ({"logits_dtype": "float64"}, "`logits_dtype`"),
    ({"seed": 2**64}, "`seed`"),
    ({"logits_dtype": torch.float32}, "`logits_dtype`"),
    ({"target_modules": "q_proj("}, "`target_modules`"),
    ({"target_modules": []}, "`target_modules`"),
    ({"target_modules": ""}, "`target_modules`"),
    ({"target_modules": ["q_proj", 3]}, "`target_modules`"),
    ({"exclude_modules": []}, "`exclude_modules`"),
    ({"exclude_modules": "[a-"}, "`exclude_modules`"),
    ({"hard": "yes"}, "`hard`"),
    ({"strict": 1}, "`strict`"),
    ({"prior": ""}, "`prior`"),
    ({"prior": 3}, "`prior`"),
    ({"prior_strength": -1.0}, "`prior_strength`"),
    ({"wanda_strength": -1.0}, "`wanda_strength`"),
    ({"wanda_strength": float("inf")}, "`wanda_strength`"),
    ({"sparse_reg": -1e-5}, "`sparse_reg`"),
    ({"sparse_reg": float("nan")}, "`sparse_reg`"),
    ({"init_std": 0.0}, "`init_std`"),
    ({"calibration_samples": 0}, "`calibration_samples`"),
    ({"calibration_seqlen": 1.5}, "`calibration_seqlen`"),
    ({"seed": "0"}, "`seed`"),
    ({"base_model_name_or_path": 7}, "`base_model_name_or_path`"),
]


@pytest.mark.parametrize(("kwargs", "field_name"), BAD_VALUES, ids=[str(k) for k, _ in BAD_VALUES])
def test_invalid_values_raise_config_error_naming_the_field(kwargs, field_name):
    with pytest.raises(ConfigError, match=field_name):
        MaskConfig(**kwargs)


def test_validate_catches_fields_changed_after_construction():
    cfg = MaskConfig()
    cfg.m = 9
    with pytest.raises(ConfigError, match="`m`"):
        cfg.validate()


def test_from_dict_rejects_unknown_and_missing_fields():
    with pytest.raises(ConfigError, match="temperature"):
        MaskConfig.from_dict({"n": 2, "m": 4, "temperature": 1.0})
    with pytest.raises(ConfigError, match="missing"):
        MaskConfig.from_dict({"n": 2, "m": 4}, require_all=True)
    assert MaskConfig.from_dict({"n": 1, "m": 4}).n == 1


def test_a_misspelt_prior_lists_the_methods():
    with pytest.raises(ConfigError, match=r"Did you mean prior='sparsegpt'\?") as info:
        get_mask_model(tiny_llama(), MaskConfig(prior="sparsegtp"))
    assert "magnitude" in str(info.value) and "owner/name" in str(info.value)
    with pytest.raises(ConfigError, match="not a one-shot method"):
        get_mask_model(tiny_llama(), MaskConfig(prior="no-such-folder"))


# ---------------------------------------------------------------------------------------------- JSON
def test_json_round_trip_keeps_every_field(tmp_path):
    cfg = MaskConfig(
        n=3,
        m=8,
        target_modules=["q_proj", "v_proj"],
        exclude_modules=r"model\.layers\.0\..*",
        tau=(3.0, 0.1),
        kappa=(50.0, 700.0),
        tau_schedule="cosine",
        kappa_schedule="exponential",
        hard=True,
        prior="magnitude",
        prior_strength=2.5,
        calibration_samples=16,
        calibration_seqlen=64,
        sparse_reg=3e-4,
        init_std=0.02,
        logits_dtype="bfloat16",
        seed=1234,
        strict=True,
        base_model_name_or_path="org/base",
    )
    cfg.save_pretrained(tmp_path)
    data = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert data["format_version"] == FORMAT_VERSION and "hf_maskllm_version" in data
    assert data["tau"] == [3.0, 0.1]
    loaded = MaskConfig.from_pretrained(tmp_path)
    assert loaded == cfg
    assert isinstance(loaded.tau, tuple) and isinstance(loaded.kappa, tuple)


def _saved_config(tmp_path, **changes) -> None:
    MaskConfig().save_pretrained(tmp_path)
    data = json.loads((tmp_path / CONFIG_NAME).read_text())
    for key, value in changes.items():
        if value is _DELETE:
            del data[key]
        else:
            data[key] = value
    (tmp_path / CONFIG_NAME).write_text(json.dumps(data))


_DELETE = object()


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"temperature": 2.0}, "temperature"),  # unknown field
        ({"sparse_reg": _DELETE}, "sparse_reg"),  # missing field
        ({"n": "2"}, "`n`"),  # wrongly typed
        ({"tau": 4.0}, "`tau`"),
        ({"tau": ["a", "b"]}, "`tau`"),
        ({"logits_dtype": 32}, "`logits_dtype`"),
        ({"target_modules": {"q": 1}}, "`target_modules`"),
        ({"format_version": FORMAT_VERSION + 1}, "newer"),
        ({"format_version": _DELETE}, "format_version"),
        ({"format_version": "1"}, "format_version"),
    ],
)
def test_bad_saved_config_raises_mask_file_error(tmp_path, changes, needle):
    _saved_config(tmp_path, **changes)
    with pytest.raises(MaskFileError, match=needle):
        MaskConfig.from_pretrained(tmp_path)


def test_saved_config_that_is_not_json_or_not_an_object(tmp_path):
    (tmp_path / CONFIG_NAME).write_text("{not json")
    with pytest.raises(MaskFileError, match="not valid JSON"):
        MaskConfig.from_pretrained(tmp_path)
    (tmp_path / CONFIG_NAME).write_text("[1, 2]")
    with pytest.raises(MaskFileError, match="JSON object"):
        MaskConfig.from_pretrained(tmp_path)


def test_missing_folder_or_file(tmp_path):
    with pytest.raises(MaskFileError, match=CONFIG_NAME):
        MaskConfig.from_pretrained(tmp_path)  # exists, but no mask_config.json
    with pytest.raises(MaskFileError):
        MaskConfig.from_pretrained(tmp_path / "nope" / "deeper" / "still")

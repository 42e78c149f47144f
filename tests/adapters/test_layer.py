"""MaskedLinear: the named masks a layer holds (logits, packed hard masks, the active one), its state dict,
the eval-mode hard mask and its cache, and straight-through samples."""

from __future__ import annotations

import pytest
import torch
from models import model_inputs, output_tensor, single_thread, tiny_llama  # noqa: F401  (single_thread: autouse)
from torch import nn

from hf_maskllm import MaskConfig, MaskedLinear, MaskModel, get_mask_model
from hf_maskllm.adapters import MaskSchedule
from hf_maskllm.adapters.layer import mask_key
from hf_maskllm.adapters.packing import pack_indices
from hf_maskllm.errors import ConfigError, MaskLLMError
from hf_maskllm.patterns import candidate_patterns

GROUPS, C = 8 * 16 // 4, 6  # an 8 x 16 layer at 2:4


def _mask_model(**cfg) -> MaskModel:
    return get_mask_model(tiny_llama(), MaskConfig(**cfg))


def _first_layer(mm: MaskModel) -> MaskedLinear:
    return mm.masked_layers()[mm.masked_names[0]]


def _layer() -> MaskedLinear:
    """A bare 8 x 16 layer at 2:4 holding no mask yet."""
    torch.manual_seed(0)
    return MaskedLinear(nn.Linear(16, 8), 2, 4)


def _logits(seed: int) -> torch.Tensor:
    return torch.randn(GROUPS, C, generator=torch.Generator().manual_seed(seed))


def _indices(seed: int) -> torch.Tensor:
    return torch.randint(0, C, (GROUPS,), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------- named masks
def test_a_layer_holds_masks_by_name_and_one_is_active():
    layer = _layer()
    assert layer.mask_names == [] and layer.active_mask is None
    with pytest.raises(MaskLLMError, match="no active mask"):
        _ = layer.mask_logits
    layer.add_mask("a", logits=_logits(0))
    layer.add_mask("b", packed=pack_indices(_indices(1), C))
    assert layer.mask_names == ["a", "b"] and layer.active_mask is None  # adding activates nothing
    assert layer.has_logits("a") and not layer.has_logits("b")
    assert layer.get_packed("a") is None and layer.get_packed("b").dtype == torch.uint8
    assert not layer.get_logits("a").requires_grad

    layer.set_mask("a", trainable=True)
    assert layer.active_mask == "a" and layer.mask_logits is layer.get_logits("a")
    assert layer.mask_logits.requires_grad and torch.equal(layer.mask_logits, _logits(0))
    assert torch.equal(layer.hard_indices(), _logits(0).argmax(-1))

    layer.set_mask("b", trainable=False, logits_dtype=torch.float64)  # decoded into one-hot logits
    assert layer.active_mask == "b" and not layer.get_logits("a").requires_grad
    assert layer.mask_logits.dtype == torch.float64 and not layer.mask_logits.requires_grad
    assert torch.equal(layer.mask_logits.argmax(-1), _indices(1))
    assert bool((layer.mask_logits.sum(-1) == 1).all())
    assert torch.equal(layer.hard_indices("b"), _indices(1)) and torch.equal(
        layer.hard_indices("a"), _logits(0).argmax(-1)
    )
    expected = candidate_patterns(2, 4, dtype=torch.bool)[_indices(1)].reshape(8, 16)
    assert torch.equal(layer.eval().hard_mask(), expected)


def test_dropping_and_deleting_masks():
    layer = _layer()
    layer.add_mask("a", logits=_logits(0))
    layer.add_mask("b", logits=_logits(2), packed=pack_indices(_logits(2).argmax(-1), C))
    layer.set_mask("b", trainable=False)
    with pytest.raises(MaskLLMError, match="'b' is active or has no packed hard mask"):
        layer.drop_logits("b")
    with pytest.raises(MaskLLMError, match="'a' is active or has no packed hard mask"):
        layer.drop_logits("a")
    layer.set_mask("a", trainable=True)
    layer.drop_logits("b")  # inactive, and packed: its logits go, the hard mask stays
    assert not layer.has_logits("b") and torch.equal(layer.hard_indices("b"), _logits(2).argmax(-1))
    assert set(dict(layer.named_parameters())) == {"base_layer.weight", "base_layer.bias", "logits.a"}
    with pytest.raises(MaskLLMError, match="'a' is the active mask"):
        layer.delete_mask("a")
    layer.delete_mask("b")
    assert layer.mask_names == ["a"] and "b" not in layer.packed_masks
    for call in (
        layer.get_logits,
        layer.get_packed,
        layer.hard_indices,
        layer.delete_mask,
        layer.drop_logits,
    ):
        with pytest.raises(MaskLLMError, match=r"No mask named 'b' in this layer; it holds \['a'\]"):
            call("b")
    with pytest.raises(MaskLLMError, match="No mask named 'b'"):
        layer.set_mask("b", trainable=True)


def test_adding_a_mask_is_checked():
    layer = _layer()
    layer.add_mask("a", logits=_logits(0))
    with pytest.raises(MaskLLMError, match="holds a mask named 'a' already"):
        layer.add_mask("a", logits=_logits(1))
    with pytest.raises(MaskLLMError, match="give its logits, its packed hard mask, or both"):
        layer.add_mask("c")
    with pytest.raises(ConfigError, match=r"logits must have shape \(32, 6\), got \(32, 5\)"):
        layer.add_mask("c", logits=torch.zeros(GROUPS, 5))
    assert layer.mask_names == ["a"]


def test_a_first_mask_given_at_construction_is_active_and_trains():
    layer = MaskedLinear(nn.Linear(16, 8), 2, 4, _logits(0), mask_name="general")
    assert layer.mask_names == ["general"] and layer.active_mask == "general"
    assert layer.mask_logits.requires_grad
    assert not layer.base_layer.weight.requires_grad and not layer.base_layer.bias.requires_grad
    assert isinstance(layer.schedule, MaskSchedule)  # a bare layer reads a schedule of its own
    shared = MaskSchedule(tau=0.5)
    assert MaskedLinear(nn.Linear(16, 8), 2, 4, _logits(0), schedule=shared).schedule is shared


# ---------------------------------------------------------------------------------------------- state dict and .to()
def _three_states() -> MaskedLinear:
    """Mask "a" active, "b" held as logits, "c.v2" held packed only."""
    layer = _layer()
    layer.add_mask("a", logits=_logits(0))
    layer.add_mask("b", logits=_logits(1))
    layer.add_mask("c.v2", packed=pack_indices(_indices(3), C))
    layer.set_mask("a", trainable=True)
    return layer


def test_state_dict_holds_every_mask_under_its_name():
    layer = _three_states()
    state = layer.state_dict()
    assert set(state) == {
        "base_layer.weight", "base_layer.bias", "logits.a", "logits.b", "packed_masks.c:v2"
    }  # fmt: skip
    assert mask_key("c.v2") == "c:v2"  # a module key cannot hold a '.'
    other = _three_states()
    with torch.no_grad():
        other.get_logits("b").zero_()
        other.get_packed("c.v2").zero_()
    other.load_state_dict(state)
    assert torch.equal(other.get_logits("b"), _logits(1))
    assert torch.equal(other.hard_indices("c.v2"), _indices(3))


def test_a_state_dict_with_the_unnamed_logits_key_loads_into_the_active_mask():
    layer = _three_states()
    state = {"mask_logits": _logits(7)}
    result = layer.load_state_dict(state, strict=False)
    assert not result.unexpected_keys
    assert torch.equal(layer.mask_logits, _logits(7)) and torch.equal(layer.get_logits("b"), _logits(1))


def test_to_moves_and_casts_every_mask_not_only_the_active_one():
    layer = _three_states().to(torch.float64)
    assert layer.get_logits("a").dtype == layer.get_logits("b").dtype == torch.float64
    assert layer.get_packed("c.v2").dtype == torch.uint8  # indices, not values
    layer = layer.to("meta")
    tensors = [layer.get_logits("a"), layer.get_logits("b"), layer.get_packed("c.v2"), layer.candidates]
    assert all(t.device.type == "meta" for t in tensors)
    assert layer.mask_logits is layer.get_logits("a") and layer.mask_logits.requires_grad


# ---------------------------------------------------------------------------------------------- eval cache and sampling
def _changed_logits(layer: MaskedLinear) -> torch.Tensor:
    """Logits whose argmax differs from the current one in every group."""
    logits = layer.mask_logits.detach().clone()
    return logits.roll(1, dims=1) if logits.shape[1] > 1 else -logits


def test_eval_mask_cache_follows_in_place_logit_changes():
    mm = _mask_model()
    mm.eval()
    inputs = model_inputs(mm)
    layer = _first_layer(mm)
    with torch.no_grad():
        before = output_tensor(mm(**inputs))
        mask_before = layer.hard_mask().clone()
        assert layer.hard_mask() is layer.hard_mask()  # cached while logits are unchanged
        layer.mask_logits.copy_(_changed_logits(layer))
        after = output_tensor(mm(**inputs))
    mask_after = layer.hard_mask()
    assert not torch.equal(mask_before, mask_after)
    cand = candidate_patterns(2, 4, dtype=torch.bool)
    assert torch.equal(mask_after, cand[layer.mask_logits.argmax(-1)].reshape(mask_after.shape))
    assert not torch.allclose(before, after)


@pytest.mark.parametrize("optimizer", ["adamw-fused", "adamw-foreach", "sgd"])
def test_eval_mask_after_optimizer_step_and_eval(optimizer):
    mm = _mask_model()
    inputs = model_inputs(mm)
    params = [p for p in mm.parameters() if p.requires_grad]
    if optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=50.0)
    elif optimizer == "adamw-fused":  # the Trainer's default; fused kernels do not bump the version counter
        opt = torch.optim.AdamW(params, lr=0.05, fused=True)
    else:
        opt = torch.optim.AdamW(params, lr=0.05, foreach=True)
    mm.eval()
    with torch.no_grad():
        before = output_tensor(mm(**inputs))
    masks_before = mm.hard_masks()
    mm.train()
    for _ in range(3):
        out = mm(**inputs, labels=inputs["input_ids"])
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    mm.eval()
    with torch.no_grad():
        after = output_tensor(mm(**inputs))
    masks_after = mm.hard_masks()
    changed = sum(int((masks_before[k] != masks_after[k]).sum()) for k in masks_before)
    assert changed > 0
    cand = candidate_patterns(2, 4, dtype=torch.bool)
    for name, layer in mm.masked_layers().items():
        expected = cand[layer.mask_logits.argmax(-1)].reshape(layer.out_features, layer.in_features)
        assert torch.equal(masks_after[name], expected), name
    assert not torch.allclose(before, after)


def test_hard_straight_through_samples_are_exact_nm_and_differentiable():
    mm = _mask_model(hard=True)
    mm.train()
    layer = _first_layer(mm)
    assert layer.schedule.hard is True
    sample = layer.sample_mask()
    groups = sample.detach().reshape(-1, 4)
    assert bool(((groups == 0) | (groups == 1)).all()) and bool((groups.sum(1) == 2).all())
    (sample * torch.randn_like(sample)).sum().backward()
    assert layer.mask_logits.grad is not None and bool(layer.mask_logits.grad.abs().sum() > 0)

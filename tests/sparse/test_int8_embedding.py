"""The output layer (and the input embedding tied to it) stored as int8 rows with float16 scales
(``embedding="int8"``, format version 2): round trips with tied (Llama) and untied (Qwen2) embeddings, logits
against a float64 model built from independently quantized head weights, memory held after loading, re-saving
bit for bit, ``dequantize``, refusals naming the tensor, and compiled static-cache generation with no graph
break and no recompilation."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch._dynamo
from models import single_thread  # noqa: F401  (autouse fixture)
from safetensors.torch import load_file
from sparse_helpers import VOCAB, merged_model
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

import hf_maskllm.sparse  # noqa: F401  (registers the loader)
from hf_maskllm import check_nm
from hf_maskllm.errors import CheckpointError, ConfigError
from hf_maskllm.kernels.cpu_extension import cpu_kernels
from hf_maskllm.sparse import QuantizedSparseLinear, SparseLinear, save_compressed
from hf_maskllm.sparse.checkpoint import write_checkpoint_file
from hf_maskllm.sparse.int8_embedding import Int8Embedding, Int8Linear

REQUIRED = os.environ.get("HF_MASKLLM_REQUIRE_CPU_KERNELS") == "1"
needs_kernels = pytest.mark.skipif(
    cpu_kernels() is None and not REQUIRED, reason="the CPU kernels could not be built here"
)
KINDS = {"llama": True, "qwen2": False}  # tied, untied


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _ids(seed: int, length: int = 12) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _rtn_rows_float64(weight: torch.Tensor) -> torch.Tensor:
    """Independent reference: per row, scale = float16(absmax / 127), q = round(w / scale) in [-127, 127]."""
    out = torch.zeros(weight.shape, dtype=torch.float64)
    for r in range(weight.shape[0]):
        row = weight[r].float()
        scale = torch.tensor(float(row.abs().max()) / 127, dtype=torch.float32).half().float()
        if scale > 0:
            out[r] = (torch.round(row / scale).clamp(-127, 127) * scale).double()
    return out


def _reference(kind: str) -> torch.nn.Module:
    """The merged model in float64 with its output weight (tied: the shared table) replaced by the reference."""
    model = merged_model(kind).double()
    with torch.no_grad():
        model.get_output_embeddings().weight.copy_(_rtn_rows_float64(merged_model(kind).lm_head.weight))
    return model


def _saved(tmp_path: Path, kind: str = "llama", **kwargs) -> Path:
    save_compressed(merged_model(kind), tmp_path / "c", embedding="int8", **kwargs)
    return tmp_path / "c"


# ------------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("kind", list(KINDS))
def test_round_trip_stores_the_table_once_and_loads_int8_layers(kind, tmp_path):
    tied = KINDS[kind]
    folder = _saved(tmp_path, kind)
    q = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert (q["format_version"], q["embedding"]) == (2, "int8") and "values" not in q
    files = _tensors(folder)
    prefix = "model.embed_tokens" if tied else "lm_head"
    assert files[f"{prefix}.qweight"].dtype == torch.int8 and files[f"{prefix}.qweight"].shape == (VOCAB, 64)
    assert files[f"{prefix}.scales"].dtype == torch.float16 and files[f"{prefix}.scales"].shape == (VOCAB,)
    assert "lm_head.weight" not in files
    assert ("model.embed_tokens.weight" in files) == (not tied)
    assert not any(k.startswith("lm_head.") for k in files) or not tied

    loaded = AutoModelForCausalLM.from_pretrained(folder)
    head = loaded.get_output_embeddings()
    assert isinstance(head, Int8Linear) and head.tied == tied
    assert isinstance(loaded.get_input_embeddings(), Int8Embedding if tied else torch.nn.Embedding)
    if tied:
        assert head.table() is loaded.get_input_embeddings()
    assert sum(isinstance(mod, SparseLinear) for mod in loaded.modules()) == len(q["modules"])
    # the codes are the reference's, exactly
    torch.testing.assert_close(
        head.dense_weight(torch.float64), _rtn_rows_float64(merged_model(kind).lm_head.weight), rtol=0, atol=0
    )

    # tensors held: the checkpoint's bytes, nothing duplicated
    held = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in loaded.state_dict().values()
    }
    stored = sum(t.numel() * t.element_size() for t in files.values())
    assert sum(held.values()) <= 1.05 * stored

    # a save of the loaded model writes the same tensors and config again, bit for bit
    loaded.save_pretrained(tmp_path / "again")
    again = _tensors(tmp_path / "again")
    assert set(again) == set(files) and all(torch.equal(again[k], files[k]) for k in files)
    assert json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"] == q


@needs_kernels
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("length", [1, 12])  # the direct int8 kernel (decode) and the dequantize + GEMM route
def test_logits_equal_a_float64_model_with_independently_quantized_head(kind, length, tmp_path):
    loaded = AutoModelForCausalLM.from_pretrained(_saved(tmp_path, kind))
    ids = _ids(1, length)
    with torch.no_grad():
        got = loaded(ids).logits.double()
        expected = _reference(kind)(ids).logits
        unquantized = merged_model(kind).double()(ids).logits
    # float32 sums (and, with AVX-512 VNNI, 8-bit rounded activations per 32 inputs) against float64
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-2)
    assert (got - expected).abs().max() < (
        unquantized - expected
    ).abs().max()  # the test can see the head's codes


def test_bfloat16_load_keeps_float16_scales_and_int8_codes(tmp_path):
    loaded = AutoModelForCausalLM.from_pretrained(_saved(tmp_path), dtype=torch.bfloat16)
    emb = loaded.get_input_embeddings()
    assert emb.qweight.dtype == torch.int8 and emb.scales.dtype == torch.float16
    with torch.no_grad():
        out = loaded(_ids(2)).logits
    assert out.dtype == torch.bfloat16 and emb(_ids(2)).dtype == torch.bfloat16


@pytest.mark.parametrize("kind", list(KINDS))
def test_tie_weights_keeps_the_int8_layers_and_ties_again_after_dequantize(kind, tmp_path):
    folder = _saved(tmp_path, kind)
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    ids = _ids(5)
    with torch.no_grad():
        before = loaded(ids).logits
    loaded.tie_weights()  # transformers' own call: nothing left for it to tie (the int8 head reads the table)
    head = loaded.get_output_embeddings()
    assert isinstance(head, Int8Linear) and head.tied == KINDS[kind]
    assert isinstance(loaded.get_input_embeddings(), Int8Embedding if KINDS[kind] else torch.nn.Embedding)
    if KINDS[kind]:
        assert head.table() is loaded.get_input_embeddings()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, before)

    plain = loaded.dequantize()
    plain.tie_weights()
    assert (plain.lm_head.weight is plain.model.embed_tokens.weight) == KINDS[kind]
    assert "_tied_weights_keys" not in plain.__dict__  # the class's mapping again
    assert ("lm_head.weight" in plain.all_tied_weights_keys) == KINDS[kind]


@pytest.mark.parametrize("kind", list(KINDS))
def test_dequantize_gives_a_plain_float_model_and_generate_gives_the_same_tokens(kind, tmp_path):
    folder = _saved(tmp_path, kind)
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    plain = AutoModelForCausalLM.from_pretrained(folder).dequantize()
    assert not any(isinstance(mod, (Int8Linear, Int8Embedding, SparseLinear)) for mod in plain.modules())
    assert (plain.lm_head.weight is plain.model.embed_tokens.weight) == KINDS[kind]
    torch.testing.assert_close(
        plain.lm_head.weight.double(), loaded.lm_head.dense_weight(torch.float64), rtol=0, atol=0
    )
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        for seed in (3, 4):
            prompt = _ids(seed, 5)[:1]
            assert torch.equal(loaded.generate(prompt, **kwargs), plain.generate(prompt, **kwargs))


def test_float_layers_with_int8_head_and_int8_layers_with_int8_head_both_load(tmp_path):
    save_compressed(merged_model("llama"), tmp_path / "q", values="int8", group_size=16, embedding="int8")
    q = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert (q["format_version"], q["values"], q["embedding"]) == (2, "int8", "int8")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert any(isinstance(mod, QuantizedSparseLinear) for mod in loaded.modules())
    assert isinstance(loaded.lm_head, Int8Linear)
    report = check_nm(loaded, n=2, m=4)
    assert report is not None
    card = (tmp_path / "q" / "README.md").read_text()
    assert "| output embedding | int8, one float16 scale per row" in card


def test_a_float_save_of_an_int8_head_model_is_refused(tmp_path):
    loaded = AutoModelForCausalLM.from_pretrained(_saved(tmp_path))
    with pytest.raises(ConfigError, match=r"output embedding is int8; call model.dequantize\(\) first"):
        loaded.save_pretrained(tmp_path / "f", embedding="float")
    with pytest.raises(ConfigError, match=r"`embedding` must be one of \['int8'\]"):
        save_compressed(merged_model("llama"), tmp_path / "x", embedding="int4")
    assert not (tmp_path / "f").exists() and not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------------------- other writers
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_mask_model_merged_save_merge_checkpoint_and_the_cli_write_the_same_tensors(tied, tmp_path):
    from models import tiny_llama, tiny_llama_tied

    from hf_maskllm import MaskConfig, get_mask_model, merge_checkpoint
    from hf_maskllm.cli import main

    base = (tiny_llama_tied if tied else tiny_llama)().to(torch.bfloat16)
    base.save_pretrained(tmp_path / "dense")
    mask_model = get_mask_model(base, MaskConfig(prior="magnitude"))
    mask_model.save_pretrained(tmp_path / "mask")
    mask_model.save_pretrained(tmp_path / "in_memory", merged=True, embedding="int8")
    merge_checkpoint(
        tmp_path / "dense", tmp_path / "mask", tmp_path / "streamed", progress=False, embedding="int8"
    )
    main(["merge", "--model", str(tmp_path / "dense"), "--mask", str(tmp_path / "mask"),
          "--output", str(tmp_path / "cli"), "--values", "int8", "--group-size", "16", "--embedding", "int8"])  # fmt: skip
    a, b, c = (_tensors(tmp_path / name) for name in ("in_memory", "streamed", "cli"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    prefix = "model.embed_tokens" if tied else "lm_head"
    for files in (a, c):
        assert files[f"{prefix}.qweight"].dtype == torch.int8 and "lm_head.weight" not in files
        assert torch.equal(files[f"{prefix}.qweight"], a[f"{prefix}.qweight"])
    q = json.loads((tmp_path / "streamed" / "config.json").read_text())["quantization_config"]
    assert q == json.loads((tmp_path / "in_memory" / "config.json").read_text())["quantization_config"]
    assert (q["format_version"], q["embedding"]) == (2, "int8")
    qc = json.loads((tmp_path / "cli" / "config.json").read_text())["quantization_config"]
    assert (qc["values"], qc["embedding"]) == ("int8", "int8")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "streamed")
    assert isinstance(loaded.lm_head, Int8Linear) and loaded.lm_head.tied == tied
    report = check_nm(loaded, 2, 4)
    assert "lm_head: int8 output embedding, one float16 scale per row" in str(report)
    assert ("tied to the input embedding" in report.embeddings["lm_head"]) == tied
    assert "the output embedding in int8" in (tmp_path / "streamed" / "README.md").read_text()


def test_a_scaled_word_embedding_is_refused_before_anything_is_written(tmp_path):
    from models import tiny_gemma
    from sparse_helpers import magnitude_prune

    from hf_maskllm.errors import TargetError

    model = tiny_gemma().eval()  # Gemma's input embedding multiplies its rows by sqrt(hidden)
    magnitude_prune(model)
    with pytest.raises(
        TargetError, match=r"'model.embed_tokens' tied to 'lm_head' is a Gemma\w*ScaledWordEmbedding"
    ):
        save_compressed(model, tmp_path / "c", embedding="int8")
    assert not (tmp_path / "c").exists()


def test_dtype_casts_move_the_codes_and_keep_the_float16_scales(tmp_path):
    for kind in KINDS:
        loaded = AutoModelForCausalLM.from_pretrained(_saved(tmp_path / kind, kind))
        loaded.to(torch.bfloat16)
        head = loaded.lm_head
        assert head.scales.dtype == torch.float16 and head.qweight.dtype == torch.int8
        assert head.weight_dtype == torch.bfloat16 and head.dense_weight().dtype == torch.bfloat16
        with torch.no_grad():
            assert loaded(_ids(5)).logits.dtype == torch.bfloat16


def test_the_dequantizing_route_serves_gradients_and_the_embedding_gathers_scaled_rows(tmp_path):
    loaded = AutoModelForCausalLM.from_pretrained(_saved(tmp_path))
    head, emb = loaded.lm_head, loaded.get_input_embeddings()
    reference = _rtn_rows_float64(merged_model("llama").lm_head.weight)
    x = torch.randn(3, 64, dtype=torch.float64, requires_grad=True)
    y = head(x)  # a gradient is needed: the dequantized weight, not the kernel
    torch.testing.assert_close(y, x @ reference.T)
    y.sum().backward()
    torch.testing.assert_close(x.grad, reference.sum(0).expand(3, -1))
    ids = _ids(6)
    torch.testing.assert_close(emb(ids).double(), reference[ids], rtol=0, atol=0)  # exact in float32


# ------------------------------------------------------------------------------------------- load refusals
def _edit_tensors(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    write_checkpoint_file(tensors, folder / "model.safetensors")  # valid checksums: only the loader's checks


def _edit_config(folder: Path, edit) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg["quantization_config"])
    path.write_text(json.dumps(cfg))


T = "model.embed_tokens"


@pytest.mark.parametrize(
    ("edit_tensors", "edit_config", "message"),
    [
        (lambda t: t.update({f"{T}.scales": t[f"{T}.scales"][:-1]}), None, rf"{T}.scales \[127\] \(model: \[128\]\)"),
        (lambda t: t[f"{T}.scales"].__setitem__(5, float("inf")), None, rf"'{T}'.*`scales` holds NaN or inf"),
        (lambda t: t[f"{T}.qweight"].__setitem__((3, 4), -128), None, rf"'{T}'.*code -128"),
        (lambda t: t.update({f"{T}.qweight": t[f"{T}.qweight"].half()}), None, rf"{T}.qweight is stored as F16"),
        (lambda t: t.update({f"{T}.scales": t[f"{T}.scales"].float()}), None, rf"{T}.scales is stored as F32"),
        (lambda t: t.pop(f"{T}.scales"), None, rf"lacks 1 tensor\(s\).*{T}.scales"),
        (None, lambda q: q.update(embedding="int4"), r"quantization_config.embedding must be one of \['int8'\]"),
        (None, lambda q: q.update(format_version=1), r"only format version 2 has, but its format_version is 1"),
        (None, lambda q: q.pop("embedding"), r"quantization_config.values must be one of"),
    ],
    ids=["scale-count", "inf-scale", "code-minus-128", "float16-codes", "float32-scales", "missing-scales",
         "unknown-embedding", "version-1-with-embedding", "config-without-embedding"],
)  # fmt: skip
def test_load_refuses_inconsistent_files_naming_the_tensor(tmp_path, edit_tensors, edit_config, message):
    folder = _saved(tmp_path)
    if edit_tensors is not None:
        _edit_tensors(folder, edit_tensors)
    if edit_config is not None:
        _edit_config(folder, edit_config)
    with pytest.raises(CheckpointError, match=message):
        AutoModelForCausalLM.from_pretrained(folder)


# ------------------------------------------------------------------------------------------- torch.compile
@needs_kernels
@pytest.mark.parametrize("kind", list(KINDS))
def test_static_cache_generation_compiles_once_and_gives_the_eager_tokens(kind, tmp_path):
    torch._dynamo.reset()
    counters.clear()
    model = AutoModelForCausalLM.from_pretrained(_saved(tmp_path, kind))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (1, 6), generator=g) for _ in range(2)]
    kwargs = dict(
        max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
        cache_implementation="static", return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip
    try:
        with torch.no_grad():
            eager = [model.generate(prompt, **kwargs) for prompt in prompts]
            counter = CompileCounterWithBackend("aot_eager")
            model.forward = torch.compile(model.forward, backend=counter, fullgraph=True)
            got = [model.generate(prompt, **kwargs) for prompt in prompts]
        assert counter.frame_count == 2 and not counters["graph_break"]  # prefill + decode, then nothing new
        ops = [
            str(node.target) for gm in counter.graphs for node in gm.graph.nodes if node.op == "call_function"
        ]
        assert sum("hf_maskllm.int8_linear" in op for op in ops) == 2  # the head is one opaque kernel node
        for compiled, reference in zip(got, eager):
            assert torch.equal(compiled.sequences, reference.sequences)
            for a, b in zip(compiled.logits, reference.logits):
                torch.testing.assert_close(a, b)
    finally:
        torch._dynamo.reset()


def test_quantize_rows_in_chunks_equals_the_reference_and_refuses_nan():
    from hf_maskllm.sparse.int8_embedding import quantize_rows

    weight = torch.randn(37, 19, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    weight[5] = 0  # a row of zeros: scale 0, codes 0
    qweight, scales = quantize_rows(weight, chunk=8)  # rows in several chunks, the last one short
    assert qweight.dtype == torch.int8 and scales.dtype == torch.float16 and int(qweight.abs().max()) == 127
    got = qweight.double() * scales.double()[:, None]
    torch.testing.assert_close(got, _rtn_rows_float64(weight), rtol=0, atol=0)
    assert float(scales[5]) == 0 and not qweight[5].any()
    weight[30, 3] = float("nan")
    with pytest.raises(CheckpointError, match="NaN or inf"):
        quantize_rows(weight, chunk=8)

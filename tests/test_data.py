"""Text sources, token windows and calibration batches (hf_maskllm.data)."""

from __future__ import annotations

import json

import pytest
import torch

from hf_maskllm.data import (
    calibration_tokens,
    causal_lm_dataset,
    load_embedded_texts,
    load_texts,
    tokenize_windows,
)
from hf_maskllm.errors import DataError


class CharTokenizer:
    """One token per character (ids 0..127), returning what a HF tokenizer returns."""

    def __call__(self, text, return_tensors=None, verbose=True):
        ids = [min(ord(c), 127) for c in text]
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}


TOK = CharTokenizer()


def test_tokenize_windows_cuts_exact_non_overlapping_windows():
    texts = ["abcdefg", "hij"]  # joined: "abcdefg\n\nhij" = 12 characters
    windows = tokenize_windows(texts, TOK, seqlen=5)
    joined = "abcdefg\n\nhij"
    assert windows.dtype == torch.long and windows.shape == (2, 5)  # 12 // 5 = 2, remainder of 2 dropped
    assert windows.flatten().tolist() == [ord(c) for c in joined[:10]]
    assert tokenize_windows(texts, TOK, seqlen=4).shape == (3, 4)  # exact fit, nothing dropped
    assert (
        tokenize_windows(texts, TOK, seqlen=4, max_windows=2).tolist()
        == tokenize_windows(texts, TOK, 4)[:2].tolist()
    )


def test_tokenize_windows_too_short_and_empty():
    with pytest.raises(DataError, match="3 tokens, fewer than one window of seqlen=8"):
        tokenize_windows(["abc"], TOK, seqlen=8)
    with pytest.raises(DataError, match="no text"):
        tokenize_windows(["", "  "], TOK, seqlen=2)
    with pytest.raises(DataError, match="Unsupported data source"):
        tokenize_windows([], TOK, seqlen=2)
    with pytest.raises(DataError, match="seqlen"):
        tokenize_windows(["abcdef"], TOK, seqlen=1)


def test_calibration_tokens_seeded_distinct_windows():
    text = "".join(chr(33 + i % 90) for i in range(400))  # 400 tokens -> 50 windows of 8
    all_windows = tokenize_windows([text], TOK, 8)
    a = calibration_tokens([text], TOK, num_samples=10, seqlen=8, seed=3)
    b = calibration_tokens([text], TOK, num_samples=10, seqlen=8, seed=3)
    c = calibration_tokens([text], TOK, num_samples=10, seqlen=8, seed=4)
    assert a.shape == (10, 8) and torch.equal(a, b) and not torch.equal(a, c)
    rows = {tuple(r) for r in all_windows.tolist()}
    assert all(tuple(r) in rows for r in a.tolist())  # each sample is one of the aligned windows
    assert len({tuple(r) for r in a.tolist()}) == 10 or len(rows) < 50  # distinct windows
    with pytest.raises(DataError, match="50 windows of 8 tokens, fewer than num_samples=51"):
        calibration_tokens([text], TOK, num_samples=51, seqlen=8)


def test_causal_lm_dataset_columns():
    ds = causal_lm_dataset(["abcdefghijklmnop"], TOK, seqlen=5, max_samples=2)
    assert ds.column_names == ["input_ids", "labels"] and len(ds) == 2
    assert ds[1]["input_ids"] == ds[1]["labels"] == [ord(c) for c in "fghij"]


def test_load_texts_from_files_and_dataset(tmp_path):
    import datasets

    txt = tmp_path / "a.txt"
    txt.write_text("first line\nsecond line\n", encoding="utf-8")
    assert load_texts(txt) == ["first line", "second line"]
    assert load_texts(str(txt)) == ["first line", "second line"]

    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text(
        "\n".join(json.dumps({"body": t, "id": i}) for i, t in enumerate(["x y", "z"])), encoding="utf-8"
    )
    assert load_texts(jsonl, text_column="body") == ["x y", "z"]
    with pytest.raises(DataError, match="no column 'text'"):
        load_texts(jsonl)

    ds = datasets.Dataset.from_dict({"text": ["one", "two"], "other": [1, 2]})
    assert load_texts(ds) == ["one", "two"]
    with pytest.raises(DataError, match="no column 'content'"):
        load_texts(ds, text_column="content")
    with pytest.raises(DataError, match="DatasetDict"):
        load_texts(datasets.DatasetDict({"train": ds}))
    assert load_texts(["plain", "texts"]) == ["plain", "texts"]


def test_load_texts_errors(tmp_path):
    bad = tmp_path / "c.csv"
    bad.write_text("text\nhello\n")
    with pytest.raises(DataError, match="Unsupported data file"):
        load_texts(bad)
    with pytest.raises(DataError, match="neither an existing file nor an embedded corpus"):
        load_texts("no/such/file.txt")
    with pytest.raises(DataError, match="Unsupported data source"):
        load_texts(42)
    with pytest.raises(DataError, match="no text"):
        load_texts([""])
    with pytest.raises(DataError, match="Unknown split 'test'"):
        load_texts("news:test")
    with pytest.raises(DataError, match="Unknown embedded corpus"):
        load_embedded_texts("c4")


@pytest.mark.parametrize("corpus, num_all", [("wikipedia", 100), ("news", 293)])
def test_embedded_splits_disjoint_and_deterministic(corpus, num_all):
    train = load_embedded_texts(corpus, "train")
    heldout = load_embedded_texts(corpus, "heldout")
    everything = load_embedded_texts(corpus, "all")
    assert (
        len(everything) == len(set(everything)) == num_all
        and len(heldout) == num_all // 5
        and len(train) == num_all - num_all // 5
    )
    assert not set(train) & set(heldout)
    assert everything[4] == heldout[0] and everything[0] == train[0] and everything[9] == heldout[1]
    assert load_texts(f"{corpus}:heldout") == heldout and load_texts(corpus) == everything
    assert all(len(t) > 100 for t in everything)
    if corpus == "wikipedia":
        assert all(len(t) > 2000 for t in everything) and everything[0].startswith("'''Anarchism'''")


def _byte_tokenizer(bos: bool):
    """A real ``PreTrainedTokenizerFast`` (one token per byte), adding ``<bos>`` before every text or not."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<bos>": 0, "<eos>": 1, **{chr(i): i + 2 for i in range(32, 127)}, "\n": 129}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>")


@pytest.mark.parametrize("bos", [True, False])
def test_every_window_starts_as_the_tokenizer_starts_a_text(bos):
    tok = _byte_tokenizer(bos)
    assert tok("ab")["input_ids"] == ([0] if bos else []) + [tok.convert_tokens_to_ids(c) for c in "ab"]
    text = "".join(chr(33 + i % 90) for i in range(100))
    plain = tok(text, add_special_tokens=False)["input_ids"]
    windows = tokenize_windows([text], tok, seqlen=10)
    if bos:  # 9 text tokens after BOS in every window, the text continuing from window to window
        assert windows.shape == (11, 10)
        assert windows[:, 0].tolist() == [0] * 11
        assert windows[:, 1:].flatten().tolist() == plain[:99]
    else:  # plain slices: no special token anywhere
        assert windows.shape == (10, 10)
        assert windows.flatten().tolist() == plain
    # calibration windows and training windows come from the same cut
    calib = calibration_tokens([text], tok, num_samples=4, seqlen=10, seed=0)
    assert (calib[:, 0] == 0).all() == bos
    dataset = causal_lm_dataset([text], tok, seqlen=10)
    assert [row[0] == 0 for row in dataset["input_ids"]] == [bos] * len(dataset)


def test_window_too_short_for_the_prefix():
    with pytest.raises(DataError, match="at least 3 tokens"):
        tokenize_windows(["abcdef"], _byte_tokenizer(True), seqlen=2)

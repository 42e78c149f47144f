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


def test_a_text_is_tokenized_once_per_tokenizer_and_its_windows_are_fresh_tensors():
    """Calibration and learning windows of one corpus come from one tokenization; a changed text or vocabulary
    tokenizes anew, and changing returned windows changes nothing a later call returns."""

    class Counting(CharTokenizer):
        def __init__(self):
            self.calls, self.vocab = 0, 128

        def __len__(self):
            return self.vocab

        def __call__(self, text, **kwargs):
            self.calls += text != "Hello"  # not text_prefix_ids' probe
            kwargs.pop("add_special_tokens", None)
            return super().__call__(text, **kwargs)

    tok, texts = Counting(), ["abcdefghij" * 10, "klmnop" * 10]
    first = calibration_tokens(texts, tok, num_samples=3, seqlen=8)
    windows = tokenize_windows(texts, tok, seqlen=5)
    assert tok.calls == 1
    assert windows.tolist() == tokenize_windows(texts, TOK, seqlen=5).tolist()  # as a fresh tokenization
    windows.fill_(0)
    assert (
        calibration_tokens(texts, tok, num_samples=3, seqlen=8).tolist() == first.tolist() and tok.calls == 1
    )
    tokenize_windows(texts[:1], tok, seqlen=5)  # another text
    tok.vocab += 1  # tokens added: the same text tokenizes anew
    assert tokenize_windows(texts, tok, seqlen=5).tolist() == tokenize_windows(texts, TOK, seqlen=5).tolist()
    assert tok.calls == 3
    assert (
        tokenize_windows(texts, Counting(), seqlen=5).tolist()
        == tokenize_windows(texts, TOK, seqlen=5).tolist()
    )


def test_wikipedia_is_extracted_once_per_machine_and_a_bad_cache_is_rebuilt(tmp_path, monkeypatch):
    """The articles extracted from gensim's dump are kept in the cache folder; the next process reads the
    same articles from there, and a damaged or unwritable cache falls back to the extraction."""
    from hf_maskllm import data

    monkeypatch.setenv("HF_MASKLLM_CACHE", str(tmp_path / "cache"))
    data._embedded_articles.cache_clear()
    # every call below reads the cache folder: no in-process memory of the articles
    monkeypatch.setattr(data, "_embedded_articles", data._embedded_articles.__wrapped__)
    extracted = data._embedded_articles("wikipedia")
    cached = data._wiki_cache_file(data._gensim_test_data() / data._WIKI_FILE)
    assert cached.parent == tmp_path / "cache" / "corpora"
    assert [p.name for p in cached.parent.iterdir()] == [cached.name]  # no temporary file left behind
    assert json.loads(cached.read_text(encoding="utf-8")) == list(extracted) and len(extracted) == 100

    calls = []
    monkeypatch.setattr(data, "_extract_wiki", lambda source: calls.append(source) or extracted)
    assert data._embedded_articles("wikipedia") == extracted and calls == []  # read from the cache

    for damaged in (cached.read_text(encoding="utf-8")[:1000], "[]", '{"a": 1}', "[1, 2]"):
        cached.write_text(damaged, encoding="utf-8")
        assert data._embedded_articles("wikipedia") == extracted
        assert json.loads(cached.read_text(encoding="utf-8")) == list(extracted)  # rewritten whole
    assert len(calls) == 4

    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("HF_MASKLLM_CACHE", str(blocked))  # a cache that cannot be written
    assert data._embedded_articles("wikipedia") == extracted
    assert blocked.read_text() == "not a folder"


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

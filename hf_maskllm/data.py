"""Text sources, token windows and calibration batches: the one data path of hf_maskllm.

Every consumer (one-shot priors, mask learning, perplexity) goes through the same steps:
:func:`load_texts` turns a source into a list of strings, :func:`tokenize_windows` joins them with
``"\\n\\n"``, tokenizes once and cuts non-overlapping windows (the SparseGPT / MaskLLM protocol).
Every window starts the way the tokenizer starts a text: where it adds a BOS token (Gemma, Llama 3)
each window begins with it, followed by ``seqlen - 1`` tokens of text; where it adds none (SmolLM2,
GPT-2) the windows are plain slices of the text. A model that always sees BOS first in use is then
calibrated, trained and evaluated on inputs of that shape.

Two real corpora ship offline inside the ``gensim`` wheel (:func:`load_embedded_texts`):

- ``"wikipedia"``: the 100 articles longer than 2,000 characters (after ``filter_wiki``) of gensim's
  shortened English Wikipedia dump, in file order (about 3.1 M characters). They are extracted once per
  machine and kept under :func:`~hf_maskllm.cache.cache_root` ``/corpora``.
- ``"news"``: the 293 distinct articles of ``lee_background.cor`` (300 lines, one article per line,
  7 repeated; first occurrences kept), in file order.

Fixed split rule, by article index ``i`` in that order: ``i % 5 == 4`` is ``"heldout"`` (every fifth
article: 20 Wikipedia / 58 news articles), the rest is ``"train"`` (used for calibration and mask
learning); ``"all"`` is every article. Splits never change between runs or machines.
"""

from __future__ import annotations

import bz2
import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .cache import cache_root
from .errors import DataError

logger = logging.getLogger(__name__)

__all__ = [
    "EMBEDDED_CORPORA",
    "EMBEDDED_SPLITS",
    "calibration_tokens",
    "causal_lm_dataset",
    "load_embedded_texts",
    "load_texts",
    "text_prefix_ids",
    "tokenize_windows",
]

EMBEDDED_CORPORA = ("news", "wikipedia")
EMBEDDED_SPLITS = ("all", "heldout", "train")
HELDOUT_EVERY = 5  # article i is held out when i % HELDOUT_EVERY == HELDOUT_EVERY - 1
MIN_WIKI_CHARS = 2000

_WIKI_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
_NEWS_FILE = "lee_background.cor"
_FILE_KINDS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_EMBEDDED_NAME = re.compile(r"^(?P<corpus>[a-z]+)(?::(?P<split>[a-z]+))?$")


def _gensim_test_data() -> Path:
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "The embedded corpora ship inside the gensim wheel; install it with `pip install gensim`."
        )
    return Path(spec.submodule_search_locations[0]) / "test" / "test_data"


def _wiki_cache_file(source: Path) -> Path:
    """Where the articles extracted from ``source`` are kept: named for the gensim version, the dump's size
    and the extraction rule, so a different wheel or rule extracts anew."""
    try:
        version = importlib.metadata.version("gensim")
    except importlib.metadata.PackageNotFoundError:  # found on the path without its metadata
        version = "unknown"
    key = f"gensim-{version}-{source.stat().st_size}-min{MIN_WIKI_CHARS}-v1"
    return cache_root() / "corpora" / f"wikipedia-{key}.json"


def _read_cached_articles(path: Path) -> tuple[str, ...] | None:
    """The articles a previous extraction saved at ``path``, or None where there is no usable file."""
    try:
        articles = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(articles, list) or not articles or not all(isinstance(a, str) for a in articles):
        return None
    return tuple(articles)


def _write_cached_articles(path: Path, articles: tuple[str, ...]) -> None:
    """Save ``articles`` at ``path`` through a temporary sibling and a rename, so a reader never sees half a
    file; a cache that cannot be written (a read-only home) only costs the next process the extraction."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(list(articles), f)
        os.replace(tmp, path)
    except OSError as error:
        logger.info("hf_maskllm: could not cache the extracted Wikipedia articles at %s (%s).", path, error)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _extract_wiki(source: Path) -> tuple[str, ...]:
    """The articles of the dump ``source`` longer than ``MIN_WIKI_CHARS`` after ``filter_wiki``, runs of blank
    lines collapsed, in file order. A change to this rule changes the ``-v1`` of :func:`_wiki_cache_file`."""
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    articles = []
    with bz2.open(source, "rb") as f:
        for _title, text, _pageid in extract_pages(f):
            text = re.sub(r"\n{3,}", "\n\n", filter_wiki(text)).strip()
            if len(text) > MIN_WIKI_CHARS:
                articles.append(text)
    return tuple(articles)


@functools.lru_cache(maxsize=2)
def _embedded_articles(corpus: str) -> tuple[str, ...]:
    folder = _gensim_test_data()
    if corpus == "news":
        lines = (folder / _NEWS_FILE).read_text(encoding="utf-8").splitlines()
        # the file repeats 7 articles; keep first occurrences so no text is in both train and heldout
        return tuple(dict.fromkeys(line.strip() for line in lines if line.strip()))
    # Extracting the Wikipedia dump (bz2 and wiki markup) takes seconds; each machine does it once.
    source = folder / _WIKI_FILE
    cached = _wiki_cache_file(source)
    articles = _read_cached_articles(cached)
    if articles is None:
        articles = _extract_wiki(source)
        _write_cached_articles(cached, articles)
    return articles


def load_embedded_texts(corpus: str = "wikipedia", split: str = "all") -> list[str]:
    """Articles of an embedded corpus (``"wikipedia"`` or ``"news"``) for ``split`` (``"train"``,
    ``"heldout"`` or ``"all"``), in a fixed order; see the module docstring for the split rule."""
    if corpus not in EMBEDDED_CORPORA:
        raise DataError(f"Unknown embedded corpus {corpus!r}; choose one of {list(EMBEDDED_CORPORA)}.")
    if split not in EMBEDDED_SPLITS:
        raise DataError(
            f"Unknown split {split!r} of corpus {corpus!r}; choose one of {list(EMBEDDED_SPLITS)}."
        )
    articles = _embedded_articles(corpus)
    if split == "all":
        return list(articles)
    heldout = split == "heldout"
    return [a for i, a in enumerate(articles) if (i % HELDOUT_EVERY == HELDOUT_EVERY - 1) == heldout]


def _load_files(paths: list[Path], text_column: str) -> list[str]:
    kinds = {_FILE_KINDS.get(p.suffix.lower()) for p in paths}
    if None in kinds:
        bad = [str(p) for p in paths if p.suffix.lower() not in _FILE_KINDS]
        raise DataError(f"Unsupported data file(s) {bad}; use {sorted(_FILE_KINDS)} files.")
    if len(kinds) > 1:
        raise DataError(
            f"Data files {[str(p) for p in paths]} mix formats; pass files of one kind at a time."
        )
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise DataError(f"Data file(s) {missing} do not exist.")
    import datasets

    kind = kinds.pop()
    dataset = datasets.load_dataset(kind, data_files=[str(p) for p in paths], split="train")
    return _column(dataset, text_column, f"{kind} file(s) {[str(p) for p in paths]}")


def _column(dataset: Any, text_column: str, what: str) -> list[str]:
    if text_column not in dataset.column_names:
        raise DataError(
            f"{what} has no column {text_column!r} (columns: {dataset.column_names}); pass text_column=..."
        )
    return [t for t in dataset[text_column] if t is not None]


def load_texts(source: Any, text_column: str = "text") -> list[str]:
    """Turn a data source into a list of texts.

    ``source`` may be: a list of strings; a ``datasets.Dataset``; a path or list of paths to
    ``.txt`` (one text per line, as ``datasets``' text loader gives wikitext), ``.jsonl`` / ``.json``
    or ``.parquet`` files; or an embedded corpus name ``"wikipedia"``, ``"news"``, optionally with a
    split: ``"wikipedia:heldout"``, ``"news:train"``. ``text_column`` names the column to read.
    """
    what = repr(source) if isinstance(source, str | os.PathLike) else type(source).__name__
    if isinstance(source, str | os.PathLike) and not os.path.exists(source):
        match = _EMBEDDED_NAME.match(str(source))
        if match is None or match["corpus"] not in EMBEDDED_CORPORA:
            raise DataError(
                f"Data source {source!r} is neither an existing file nor an embedded corpus; pass a path to a "
                f"{sorted(_FILE_KINDS)} file or one of {list(EMBEDDED_CORPORA)} (optionally ':train' / ':heldout')."
            )
        texts = load_embedded_texts(match["corpus"], match["split"] or "all")
    elif isinstance(source, str | os.PathLike):
        texts = _load_files([Path(source)], text_column)
    elif type(source).__name__ == "Dataset" and hasattr(source, "column_names"):
        texts = _column(source, text_column, "Dataset")
    elif type(source).__name__ in ("DatasetDict", "IterableDatasetDict"):
        raise DataError(
            f"Got a DatasetDict with splits {list(source)}; pass one split, e.g. dataset['train']."
        )
    elif isinstance(source, Sequence) and source and all(isinstance(s, str | os.PathLike) for s in source):
        if all(isinstance(s, str) and not os.path.exists(s) for s in source):
            texts = list(source)  # a list of texts
        else:
            texts = _load_files([Path(s) for s in source], text_column)
    else:
        raise DataError(
            f"Unsupported data source {what}; pass a list of str, a datasets.Dataset, a path to a "
            f"{sorted(_FILE_KINDS)} file, or an embedded corpus name like 'wikipedia:train'."
        )
    if not any(t.strip() for t in texts if isinstance(t, str)):
        raise DataError(f"Data source {what} holds no text; pass a non-empty source.")
    return texts


def text_prefix_ids(tokenizer: Any) -> list[int]:
    """The token ids ``tokenizer`` puts before the text of every input (``[bos_id]`` for Gemma or
    Llama 3, ``[]`` for SmolLM2 or GPT-2), found by tokenizing a probe with and without special tokens."""
    probe = "Hello"
    with_special = list(tokenizer(probe, verbose=False)["input_ids"])
    try:
        plain = list(tokenizer(probe, add_special_tokens=False, verbose=False)["input_ids"])
    except TypeError:  # a tokenizer without the switch adds nothing
        return []
    for start in range(len(with_special) - len(plain) + 1):
        if with_special[start : start + len(plain)] == plain:
            return [int(i) for i in with_special[:start]]
    raise DataError(
        f"Cannot tell which special tokens {type(tokenizer).__name__} adds before a text: {probe!r} tokenizes "
        f"to {with_special} with special tokens and {plain} without. Pass token ids instead of texts."
    )


# Per tokenizer, the texts it tokenized last: a job that calibrates on a corpus and then learns on it cuts
# windows of two lengths from one text, and tokenizes it once. Keyed by the text's digest and the tokenizer's
# vocabulary size (adding tokens tokenizes anew); a tokenizer is forgotten with its last reference. Only texts
# of up to _TOKENIZED_MAX_TOKENS tokens are kept (as int32: 16 MB at most each), so a large corpus holds no
# memory after its windows are cut.
_TOKENIZED: weakref.WeakKeyDictionary[Any, dict[tuple[int, bytes], torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)
_TOKENIZED_PER_TOKENIZER = 2
_TOKENIZED_MAX_TOKENS = 1 << 22


def _token_ids(text: str, tokenizer: Any) -> torch.LongTensor:
    """``text`` tokenized without special tokens, ``[T]`` (a fresh tensor the caller may change)."""
    key = (len(tokenizer) if hasattr(tokenizer, "__len__") else -1, hashlib.sha256(text.encode()).digest())
    try:
        seen = _TOKENIZED.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced or hashed: no memory of it
        seen = {}
    if key in seen:
        return seen[key].long()
    try:
        encoded = tokenizer(text, return_tensors="pt", add_special_tokens=False, verbose=False)
    except TypeError:  # a tokenizer without the switch adds nothing
        encoded = tokenizer(text, return_tensors="pt", verbose=False)
    ids = encoded["input_ids"][0].long()
    if ids.numel() <= _TOKENIZED_MAX_TOKENS and (ids.numel() == 0 or int(ids.max()) < 2**31):
        while len(seen) >= _TOKENIZED_PER_TOKENIZER:
            del seen[next(iter(seen))]
        seen[key] = ids.to(torch.int32)
    return ids


def tokenize_windows(
    texts: Any, tokenizer: Any, seqlen: int, max_windows: int | None = None
) -> torch.LongTensor:
    """Join ``texts`` with ``"\\n\\n"``, tokenize once and cut non-overlapping windows of ``seqlen``
    tokens (the remainder is dropped). ``texts`` is anything :func:`load_texts` accepts.

    Each window starts as the tokenizer starts a text (:func:`text_prefix_ids`: BOS where it adds
    one), followed by the next ``seqlen - len(prefix)`` tokens of the text.

    Returns:
        LongTensor ``[W, seqlen]``; the first ``max_windows`` windows if given.
    """
    if max_windows is not None and max_windows < 1:
        raise DataError(f"max_windows must be a positive number or None, got {max_windows}.")
    prefix = text_prefix_ids(tokenizer)
    if seqlen < len(prefix) + 2:
        raise DataError(
            f"seqlen must be at least {len(prefix) + 2} tokens (the tokenizer starts every window with "
            f"{len(prefix)} special token(s)), got {seqlen}."
        )
    body = seqlen - len(prefix)  # text tokens per window
    ids = _token_ids("\n\n".join(load_texts(texts)), tokenizer)  # [T]
    num = ids.numel() // body
    if num == 0:
        raise DataError(
            f"The text has {ids.numel()} tokens, fewer than one window of seqlen={seqlen}; "
            "pass more text or a smaller seqlen."
        )
    if max_windows is not None:
        num = min(num, max_windows)
    windows = ids[: num * body].reshape(num, body)  # [W, body]
    if prefix:
        windows = torch.cat([torch.tensor(prefix, dtype=torch.long).expand(num, -1), windows], dim=1)
    return windows.long()  # [W, seqlen]


def calibration_tokens(
    source: Any, tokenizer: Any, num_samples: int = 128, seqlen: int = 512, seed: int = 0
) -> torch.LongTensor:
    """``num_samples`` distinct non-overlapping windows of ``seqlen`` tokens, picked at random
    (seeded) from the tokenized ``source``, as SparseGPT / Wanda calibrate.

    Raises :class:`DataError` when the source yields fewer windows than ``num_samples``.
    """
    if num_samples < 1:
        raise DataError(f"num_samples must be at least 1, got {num_samples}.")
    windows = tokenize_windows(source, tokenizer, seqlen)  # [W, seqlen]
    if windows.shape[0] < num_samples:
        raise DataError(
            f"The calibration source gives {windows.shape[0]} windows of {seqlen} tokens, fewer than "
            f"num_samples={num_samples}; lower num_samples or seqlen, or add text."
        )
    generator = torch.Generator().manual_seed(seed)
    picked = torch.randperm(windows.shape[0], generator=generator)[:num_samples]
    return windows[picked]


def causal_lm_dataset(source: Any, tokenizer: Any, seqlen: int, max_samples: int | None = None) -> Any:
    """A ``datasets.Dataset`` of non-overlapping ``seqlen`` windows with ``input_ids`` and ``labels``
    (equal; the model shifts them), ready for a transformers ``Trainer`` with its default collator."""
    import datasets

    windows = tokenize_windows(source, tokenizer, seqlen, max_windows=max_samples).tolist()
    return datasets.Dataset.from_dict({"input_ids": windows, "labels": windows})

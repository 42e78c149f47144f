"""Size of the embedded corpora per split: articles, characters, SmolLM2 tokens and token windows.

    HF_HUB_OFFLINE=1 python benchmarks/corpora.py [--seqlen 512]

For each corpus (``wikipedia``, ``news``) and split (``train``, ``heldout``, ``all``) of
``load_embedded_texts``: articles, characters (summed over the articles), SmolLM2 tokens (the articles
joined with ``"\\n\\n"`` and tokenized without special tokens by the embedded tokenizer, as
``tokenize_windows`` does) and windows of ``--seqlen`` tokens as ``tokenize_windows`` cuts them.
For ``news`` also the lines of ``lee_background.cor`` (the file the library reads, located by the
library) and how many of them repeat an earlier line; for ``wikipedia`` the shortest article kept.
Writes ``benchmarks/results/corpora.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from run_info import header_lines, run_info

from hf_maskllm.data import (
    _NEWS_FILE,
    EMBEDDED_CORPORA,
    MIN_WIKI_CHARS,
    _gensim_test_data,
    load_embedded_texts,
    tokenize_windows,
)
from hf_maskllm.embedded import load_smollm2

RESULTS = Path(__file__).resolve().parent / "results"
SPLITS = ("train", "heldout", "all")


def split_row(corpus: str, split: str, tokenizer: Any, seqlen: int) -> dict:
    """Articles, characters, tokens and windows of one split."""
    texts = load_embedded_texts(corpus, split)
    ids = tokenizer("\n\n".join(texts), add_special_tokens=False, verbose=False)["input_ids"]
    return {
        "articles": len(texts),
        "characters": sum(len(t) for t in texts),
        "tokens": len(ids),
        "windows": tokenize_windows(texts, tokenizer, seqlen).shape[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--out", default=str(RESULTS / "corpora"))
    args = parser.parse_args()
    info = run_info("benchmarks/corpora.py")

    _, tokenizer = load_smollm2()
    corpora = {
        c: {s: split_row(c, s, tokenizer, args.seqlen) for s in SPLITS}
        for c in sorted(EMBEDDED_CORPORA, reverse=True)
    }
    wiki = load_embedded_texts("wikipedia", "all")
    corpora["wikipedia"]["min_chars"] = MIN_WIKI_CHARS
    corpora["wikipedia"]["shortest_article_chars"] = min(len(t) for t in wiki)
    lines = [
        line.strip() for line in (_gensim_test_data() / _NEWS_FILE).read_text(encoding="utf-8").splitlines()
    ]
    corpora["news"]["file_lines"] = len(lines)
    corpora["news"]["repeated_lines"] = len(lines) - len(set(lines))
    corpora["news"]["repeated_articles"] = len({t for t in lines if lines.count(t) > 1})
    corpora["news"]["max_appearances"] = max(lines.count(t) for t in lines)

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(
        json.dumps({**info, "args": vars(args), "corpora": corpora}, indent=2) + "\n"
    )
    news, wiki_row = corpora["news"], corpora["wikipedia"]
    md = [
        "# Embedded corpora: articles, characters, SmolLM2 tokens and windows per split",
        "",
        *header_lines(info),
        "",
        f'Tokens: the split\'s articles joined with `"\\n\\n"`, tokenized without special tokens by the '
        f"embedded SmolLM2 tokenizer; windows: `tokenize_windows(texts, tokenizer, {args.seqlen})` "
        "(the remainder dropped).",
        "",
        f"| corpus | split | articles | characters | SmolLM2 tokens | {args.seqlen}-token windows |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for c in corpora:
        for s in SPLITS:
            r = corpora[c][s]
            md.append(
                f"| {c} | {s} | {r['articles']} | {r['characters']:,} | {r['tokens']:,} | {r['windows']} |"
            )
    md += [
        "",
        f"wikipedia: articles longer than {wiki_row['min_chars']:,} characters; the shortest kept has "
        f"{wiki_row['shortest_article_chars']:,}.  ",
        f"news: `{_NEWS_FILE}` has {news['file_lines']} lines; {news['repeated_lines']} repeat an earlier "
        f"line ({news['repeated_articles']} articles appear more than once, at most "
        f"{news['max_appearances']} times), leaving "
        f"{news['all']['articles']} distinct articles.",
    ]
    Path(args.out + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()

"""The user-facing docs cite files that exist, carry no placeholders and speak to a user of the library.

Every measured number a doc quotes from a results file carries a marker right after it, an HTML
comment that does not show when the page is rendered::

    35.01 <!-- quality.json: rows.maskllm.ppl.wikipedia -->
    56.3% <!-- main_job.json: gap_closed.wikipedia *100 -->
    326.7 MiB <!-- generate_cpu.json: rows.1.tensor_bytes /1048576 -->

- the file is a json file under ``benchmarks/results/``;
- the key is a path into it, dot-separated (list items by index); a key may itself contain dots or
  spaces (``rows.+ LoRA (r=16, lr 0.001).ppl.news``): at each level the longest matching key wins;
- an optional ``*N`` or ``/N`` scales the stored value before the comparison (fractions shown as
  percentages, bytes shown in MiB);
- a number derived from several values is an expression over keys in braces, with numbers,
  ``+ - * /`` and parentheses: ``2.8 <!-- downstream.json: {rows.python-scratch.python} -
  {rows.python-transfer.python} -->``; a key of another results file is written with its file name,
  ``{other.json:rows.0.ppl}`` (a mean over runs written to several files);
- the quoted number is the last number before the marker on its line, with at most a unit between
  them (``%``, ``x``, ``MiB``, ``ms``, ``tok/s``, ...) and markdown emphasis; thousands separators are
  allowed. It must equal the stored value rounded to the number of decimals shown.

The check also fails when one key is quoted with two different numbers anywhere in the docs.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from decimal import Decimal
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [
    ROOT / "README.md",
    ROOT / "benchmarks" / "RESULTS.md",
    ROOT / "examples" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"
INTERNAL = re.compile(
    r"\bissues? ?#?\d+(?![.\dx])|this task|lent to|REFERENCE\.md|ENVIRONMENT\.md|REFERENCE section"
    r"|the issue's (budget|target)",
    re.IGNORECASE,
)
MARKER = re.compile(r"<!--\s*([\w.\-]+\.json):\s*(.+?)(?:\s+([*/])\s*([\d.e+]+))?\s*-->")
NUMBER_BEFORE = re.compile(
    r"(?<![\w.])(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)"  # the number, thousands separators allowed
    r"\s*(?:%|x|[A-Za-z][\w/\-]*)?"  # its unit
    r"[*_)\]]*\s*$"  # markdown emphasis, a closing bracket
)


def _markdown_cells(notebook: Path) -> str:
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def _doc_texts() -> dict[str, str]:
    texts = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in DOCS}
    texts[str(NOTEBOOK.relative_to(ROOT))] = _markdown_cells(NOTEBOOK)
    return texts


@cache
def _load(name: str):
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


def resolve(data, path: str):
    """The value at a dot-separated ``path``; a key containing dots matches as a whole (longest first)."""
    if not path:
        return data
    if isinstance(data, list):
        head, _, rest = path.partition(".")
        return resolve(data[int(head)], rest)
    if isinstance(data, dict):
        for key in sorted(data, key=len, reverse=True):
            if path == key or path.startswith(key + "."):
                return resolve(data[key], path[len(key) + 1 :])
    raise KeyError(path)


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(data, key: str, load=_load) -> float:
    """The number at ``key``, or the value of an expression over ``{key}`` placeholders (``{file.json:key}``
    for a key of another results file, read with ``load``)."""
    if "{" not in key:
        value = resolve(data, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{key!r} holds {value!r}, not a number")
        return value
    keys: list[str] = []

    def name(match: re.Match) -> str:
        keys.append(match.group(1))
        return f"_k{len(keys) - 1}"

    def value_of(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.Name) and node.id.startswith("_k"):
            other = re.fullmatch(r"([\w.\-]+\.json):(.+)", keys[int(node.id[2:])])
            if other:
                return evaluate(load(other.group(1)), other.group(2), load)
            return evaluate(data, keys[int(node.id[2:])], load)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value_of(node.left), value_of(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value_of(node.operand)
        raise ValueError(f"{ast.unparse(node)!r} is not a number, a {{key}}, + - * / or parentheses")

    return value_of(ast.parse(re.sub(r"\{([^{}]+)\}", name, key), mode="eval").body)


def check_numbers(text: str, where: str = "<text>", load=_load) -> tuple[list[str], list[tuple]]:
    """Errors for every marker in ``text`` whose file, key or number is wrong, and the quotes found:
    ``(file, key, scale, shown number, where)``."""
    errors, quotes = [], []
    for lineno, line in enumerate(text.splitlines(), 1):
        for marker in MARKER.finditer(line):
            name, key, op, factor = marker.groups()
            at = f"{where}:{lineno}: <!-- {name}: {key} -->"
            found = NUMBER_BEFORE.search(line[: marker.start()])
            if not found:
                errors.append(f"{at}: no number right before the marker")
                continue
            shown = found.group(1).replace(",", "")
            try:
                value = evaluate(load(name), key, load)
            except FileNotFoundError:
                errors.append(f"{at}: benchmarks/results/{name} does not exist")
                continue
            except (KeyError, IndexError):
                errors.append(f"{at}: no key {key!r} in {name}")
                continue
            except (ValueError, TypeError, SyntaxError, ZeroDivisionError) as e:
                errors.append(f"{at}: {e}")
                continue
            scale = op + factor if op else ""
            if op == "*":
                value = value * float(factor)
            elif op == "/":
                value = value / float(factor)
            decimals = len(shown.partition(".")[2])
            expected = Decimal(repr(float(value))).quantize(
                Decimal(1).scaleb(-decimals), rounding="ROUND_HALF_EVEN"
            )
            if abs(Decimal(shown) - Decimal(repr(float(value)))) > Decimal("0.5").scaleb(-decimals) * Decimal(
                "1.000001"
            ):
                errors.append(f"{at}: the doc says {shown}, the file says {expected}")
            quotes.append((name, key, scale, shown, f"{where}:{lineno}"))
    return errors, quotes


def check_one_value(quotes: list[tuple]) -> list[str]:
    """Errors for every key quoted with two different numbers (a shorter rounding of the same number,
    35.0 against 35.01, is the same value)."""
    by_key: dict[tuple, list[tuple]] = {}
    for name, key, scale, shown, where in quotes:
        by_key.setdefault((name, key, scale), []).append((shown, where))
    errors = []
    for (name, key, _), seen in by_key.items():
        coarsest = min(len(s.partition(".")[2]) for s, _ in seen)
        step = Decimal(1).scaleb(-coarsest)
        values = {Decimal(s).quantize(step, rounding="ROUND_HALF_EVEN") for s, _ in seen}
        if len(values) > 1:
            errors.append(f"{name}: {key} is quoted as " + ", ".join(f"{s} ({w})" for s, w in seen))
    return errors


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_is_clean_and_cites_existing_files(doc):
    text = doc.read_text(encoding="utf-8")
    assert not re.search(r"<<[A-Z_]+", text), "an unfilled placeholder"
    assert not INTERNAL.search(text), INTERNAL.search(text).group(0)
    cited = set(re.findall(r"(?:benchmarks/)?results/[\w.\-]+\.(?:md|json|png)", text))
    cited |= set(re.findall(r"(?:hf_maskllm|benchmarks|tests|examples)/[\w/.\-]+\.(?:py|ipynb|sh)", text))
    missing = []
    for path in cited:
        full = path if not path.startswith("results/") else f"benchmarks/{path}"
        if not (ROOT / full).exists():
            missing.append(path)
    assert not missing, f"{doc.name} cites files that do not exist: {sorted(missing)}"


def test_quoted_numbers_equal_their_results_files():
    errors, quotes = [], []
    for where, text in _doc_texts().items():
        found_errors, found_quotes = check_numbers(text, where)
        errors += found_errors
        quotes += found_quotes
    errors += check_one_value(quotes)
    assert quotes, "no marked number found: the marker pattern no longer matches the docs"
    assert not errors, "\n".join(errors)


def test_a_wrong_number_fails():
    results = {
        "t.json": {"rows": {"a.b (x)": {"ppl": 35.00754923768101}}, "frac": 0.5629, "bytes": 342163456}
    }
    good = (
        "| 35.01 <!-- t.json: rows.a.b (x).ppl --> | **35.0** <!-- t.json: rows.a.b (x).ppl --> "
        "closes 56.3% <!-- t.json: frac *100 -->, 326.3 MiB <!-- t.json: bytes /1048576 --> and "
        "342,163,456 bytes <!-- t.json: bytes -->, gap 29.5 <!-- t.json: {rows.a.b (x).ppl} - 5.5 -->, "
        "ratio 61.4% <!-- t.json: 100 * {rows.a.b (x).ppl} / ({bytes} / 6000000) -->, "
        "mean 17.75 <!-- t.json: ({rows.a.b (x).ppl} + {v.json:ppl}) / 2 -->"
    )
    results["v.json"] = {"ppl": 0.5}
    errors, quotes = check_numbers(good, load=results.__getitem__)
    assert not errors and len(quotes) == 8, errors
    for planted in (
        "35.38 <!-- t.json: rows.a.b (x).ppl -->",  # a wrong value
        "35.1 <!-- t.json: rows.a.b (x).ppl -->",  # a wrong rounding
        "56.3% <!-- t.json: frac -->",  # a missing scale
        "35.01 <!-- t.json: rows.missing -->",  # a key the file does not hold
        "35.01 <!-- u.json: frac -->",  # a file that does not exist
        "the prior <!-- t.json: frac -->",  # no number
        "29.6 <!-- t.json: {rows.a.b (x).ppl} - 5.5 -->",  # a wrong derived value
        "29.5 <!-- t.json: {rows.a.b (x).ppl} - {rows.nothing} -->",  # a key the file does not hold
        "29.5 <!-- t.json: __import__('os') -->",  # not an expression over keys
        "29.5 <!-- t.json: {frac} / ({frac} - {frac}) -->",  # division by zero
        "17.76 <!-- t.json: ({rows.a.b (x).ppl} + {v.json:ppl}) / 2 -->",  # a wrong value across files
        "17.75 <!-- t.json: ({rows.a.b (x).ppl} + {w.json:ppl}) / 2 -->",  # another file that does not exist
    ):
        errors, _ = check_numbers(
            planted, load=lambda name: results[name] if name in results else _load(name)
        )
        assert errors, planted


def test_two_values_for_one_key_fail():
    quotes = [
        ("quality.json", "rows.maskllm.ppl.wikipedia", "", "35.01", "README.md:1"),
        ("quality.json", "rows.maskllm.ppl.wikipedia", "", "35.0", "docs/a.md:2"),
    ]
    assert not check_one_value(quotes)
    quotes.append(("quality.json", "rows.maskllm.ppl.wikipedia", "", "35.38", "docs/scale.md:3"))
    assert check_one_value(quotes)


def test_a_wrong_number_planted_in_the_real_docs_fails():
    """The fixed docs pass; the same docs with one quoted number changed do not."""
    texts = _doc_texts()
    readme = texts["README.md"]
    marker = "<!-- quality.json: rows.maskllm.ppl.wikipedia -->"
    assert f"35.01 {marker}" in readme
    assert not check_numbers(readme, "README.md")[0]
    errors, _ = check_numbers(readme.replace(f"35.01 {marker}", f"35.38 {marker}"), "README.md")
    assert errors and "35.38" in errors[0]

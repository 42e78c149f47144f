"""The user-facing docs cite files that exist, carry no placeholders and speak to a user of the library."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md", *sorted((ROOT / "docs").glob("*.md"))]
INTERNAL = re.compile(
    r"\bissues? ?#?\d+(?![.\dx])|this task|lent to|REFERENCE\.md|ENVIRONMENT\.md|REFERENCE section"
    r"|the issue's (budget|target)",
    re.IGNORECASE,
)


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

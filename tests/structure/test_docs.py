"""The docs say what holds today: they cite no issue numbers (an issue is a request, closed once done;
what it asked for is described where it lives)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("examples/**/conf/*.yaml"))]
ISSUE = re.compile(r"(?<![\w&/])#\d+\b")


def test_docs_cite_no_issue_numbers():
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in DOCS
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if ISSUE.search(line)
    ]
    assert not hits, "\n".join(hits)

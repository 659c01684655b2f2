"""A tolerance or a measured figure in the README or docs/ names its evidence: the test that asserts it
(``test_*``) or the date it was measured (``2026-MM-DD``, with the machine and command beside it).

A simple pattern check, not a proof: a paragraph, list item or table row that states a figure (a
tolerance, a ratio, a percentage, GiB, seconds per step) must also carry a test name or a date, or sit
under a heading that carries one (``### Results (2026-11-27, 2-core CPU)``); a list item or table row may
also take it from the paragraph that introduces its list or table. Commands in fenced code
blocks are not claims. Mutation checked: deleting the date from
docs/parallelism.md's "Measured per-rank peaks" paragraph makes this test fail."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FIGURE = re.compile(
    r"rtol|atol|max \|diff\||\d(\.\d+)?\s*x (faster|slower|fewer|more|less|smaller|larger)|\d\s*%"
    r"|\d\s*GiB\b|\d\s*s per\b|\bwithin 1e-|\d\.\d+e-\d"
)
EVIDENCE = re.compile(r"\btest_\w+|\b20\d\d-\d\d-\d\d\b")
ITEM = re.compile(r"\s*([-*]|\d+\.)\s")


def units(text: str) -> list[tuple[int, str, str]]:
    """(first line number, text, context) of each paragraph, list item and table row outside code fences.
    The context that may carry the evidence: the heading above, and for a list item or table row also
    the paragraph that introduces its list or table."""
    found, lines, start, fenced, heading, lead = [], [], 0, False, "", ""

    def close():
        nonlocal lead
        if lines:
            unit = " ".join(lines)
            part = bool(ITEM.match(lines[0]) or unit.startswith("|"))
            found.append((start, unit, heading + " " + (lead if part else "")))
            lead = lead if part else unit
            lines.clear()

    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            close()
            fenced = not fenced
        elif fenced:
            continue
        elif line.startswith("#"):
            close()
            heading, lead = line, ""
        elif not line.strip() or line.lstrip().startswith("|") or ITEM.match(line):
            close()
            if line.strip():
                lines.append(line.strip())
                start = number
                if line.lstrip().startswith("|"):
                    close()
        else:
            start = number if not lines else start
            lines.append(line.strip())
    close()
    return found


def unbacked_figures(text: str) -> list[tuple[int, str]]:
    return [
        (n, unit) for n, unit, context in units(text) if FIGURE.search(unit) and not EVIDENCE.search(unit + context)
    ]


def test_a_figure_names_its_test_or_date():
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {FIGURE.search(unit).group(0)!r} in: {unit[:160]}"
        for path in DOCS
        for number, unit in unbacked_figures(path.read_text())
    ]
    assert not hits, f"{len(hits)} figures without a test name or a date:\n" + "\n".join(hits)


def test_the_check_flags_a_bare_figure_and_accepts_evidence():
    bare = "Intro.\n\nThe loss matches within 1e-5 of diffusers.\n\n| a | 2.4x faster |\n"
    assert [n for n, _ in unbacked_figures(bare)] == [3, 5]
    backed = "The loss matches within 1e-5 (test_parity).\n\n| a | 2.4x faster, 2026-11-28 |\n"
    assert unbacked_figures(backed) == []
    assert unbacked_figures("```\nrtol=1e-3\n```\n") == []  # a command, not a claim
    listed = "Measured 2026-11-27:\n\n- 2.4x faster\n\n| a | 5% |\n\nLater.\n\n- 2.4x faster\n"
    assert [n for n, _ in unbacked_figures(listed)] == [9]  # a list's or table's lead-in backs its items
    assert unbacked_figures("## Results (2026-11-27)\n\n| a | 2.4x faster |\n\n## Next\n\n2.4x faster.\n") == [
        (7, "2.4x faster.")
    ]

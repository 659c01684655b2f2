"""Every memory figure quoted in a recipe's comment, and every memory plan docs/parallelism.md shows, is
what ``python -m benchmarks.memory --config ...`` prints today: the command is run again (a meta-device
build of the real shapes) and its output compared."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from benchmarks.memory import main

ROOT = Path(__file__).resolve().parents[2]
CONFS = sorted(ROOT.glob("examples/megatron/recipes/*/conf/*.yaml"))
GIB = re.compile(r"(\d+(?:\.\d+)?) GiB")
# A recipe comment names its plan as "(python -m benchmarks.memory --config THIS <arguments>)".
COMMAND = re.compile(r"\(python -m benchmarks\.memory --config THIS ([^)]*)\)")
PEAK = re.compile(r"(\d+(?:\.\d+)?) GiB per GPU at its peak")


def comment_of(conf: Path) -> str:
    """The comment lines at the top of a YAML file, joined into one text."""
    lines = []
    for line in conf.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# "))
    return " ".join(lines)


def printed(argv: list[str], capsys) -> str:
    main(argv)
    return capsys.readouterr().out


QUOTING = [conf for conf in CONFS if GIB.search(comment_of(conf))]


def test_a_recipe_quotes_memory():
    assert any(conf.name == "dit_28b_64k.yaml" for conf in QUOTING)


@pytest.mark.parametrize("conf", QUOTING, ids=lambda conf: conf.name)
def test_recipe_comment_quotes_what_the_plan_prints(conf, capsys):
    comment = comment_of(conf)
    command = COMMAND.search(comment)
    assert command, f"{conf.name} quotes GiB figures without naming the plan that prints them"
    plan = printed(["--config", str(conf), *shlex.split(command.group(1))], capsys)
    quoted = GIB.findall(comment.replace(command.group(0), ""))
    assert [f for f in quoted if f"{f} GiB" not in plan] == [], f"{conf.name}: {quoted} vs the plan:\n{plan}"
    if peak := PEAK.search(comment):
        assert f"peak {peak.group(1)} GiB" in plan, plan
    if re.search(r"\bfits\b", comment):
        assert re.search(r"peak .* fits", plan), plan


def documented_plans() -> list[tuple[str, list[str]]]:
    """(command, printed lines) of every ``$ python -m benchmarks.memory --config|--recipe`` block."""
    text = (ROOT / "docs" / "parallelism.md").read_text()
    plans = []
    for block in text.split("```")[1::2]:
        lines = block.strip("\n").splitlines()
        if lines and re.match(r"\$ python -m benchmarks\.memory --(config|recipe) ", lines[0]):
            plans.append((lines[0].removeprefix("$ python -m benchmarks.memory "), lines[1:]))
    return plans


def test_parallelism_md_shows_plans():
    assert len(documented_plans()) >= 2


@pytest.mark.parametrize(
    "command, lines", [pytest.param(command, lines, id=command.split()[1]) for command, lines in documented_plans()]
)
def test_parallelism_md_shows_what_the_plan_prints(command, lines, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert printed(shlex.split(command), capsys).splitlines() == lines

"""docs/reliability.md's table of promises renders, and every test it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "reliability.md"


def promise_rows() -> list[list[str]]:
    """The cells of each row of the promises table (the table whose header starts ``| # |``)."""
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| # |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        # a cell may hold `a | b` inside backticks; split on pipes outside code spans
        cells, depth, cell = [], False, ""
        for char in line.strip()[1:-1]:
            if char == "`":
                depth = not depth
            if char == "|" and not depth:
                cells.append(cell.strip())
                cell = ""
            else:
                cell += char
        rows.append([*cells, cell.strip()])
    return rows


def case_key(case: str) -> tuple[int, str]:
    match = re.fullmatch(r"(\d+)([a-z]?)", case)
    assert match, f"case number {case!r} is not a number with an optional letter"
    return int(match.group(1)), match.group(2)


def test_every_case_is_one_row_of_four_cells_in_order() -> None:
    rows = promise_rows()
    assert len(rows) >= 20, len(rows)
    for row in rows:
        assert len(row) == 4, f"case {row[0]!r} has {len(row)} cells (two rows fused on one line?)"
        assert all(row), f"case {row[0]!r} has an empty cell"
    keys = [case_key(row[0]) for row in rows]
    assert keys == sorted(keys) and len(set(keys)) == len(keys), [row[0] for row in rows]


def test_every_test_a_case_names_exists() -> None:
    sources = {path.relative_to(ROOT).as_posix(): path.read_text() for path in (ROOT / "tests").glob("*.py")}
    defined = {name for text in sources.values() for name in re.findall(r"^\s*(?:async )?def (test_\w+)", text, re.M)}
    missing = []
    for case, *_, tests in promise_rows():
        for file in re.findall(r"tests/\w+\.py", tests):
            if file not in sources:
                missing.append((case, file))
        for name in re.findall(r"\b(test_\w+)\b", tests):
            if name not in defined and not (ROOT / "tests" / f"{name}.py").exists():
                missing.append((case, name))
    assert not missing, f"docs/reliability.md names tests that do not exist: {missing}"

"""docs/reliability.md: every row of its fault tables names a test that exists.

The suite runs those tests, so together they hold the page to "every row names a passing
test". A fault table is a table whose last column is headed `test`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "reliability.md"
TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def fault_rows() -> list[tuple[str, str]]:
    """(row, its last cell) for every body row of every table headed `... | test |`."""
    rows: list[tuple[str, str]] = []
    in_table = False
    for line in DOC.read_text().splitlines():
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[-1] == "test":
            in_table = True
        elif in_table and not set(cells[0]) <= {"-", " ", ":"}:
            rows.append((line, cells[-1]))
    return rows


def defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test")
    }


def test_every_row_names_an_existing_test():
    rows = fault_rows()
    assert len(rows) >= 20, "the fault tables lost their rows?"
    names: dict[str, set[str]] = {}
    for line, cell in rows:
        refs = TEST_REF.findall(cell)
        assert refs, f"row names no test: {line}"
        for file, name in refs:
            path = ROOT / file
            assert path.is_file(), f"{file} does not exist ({line})"
            assert name in names.setdefault(file, defined_tests(path)), f"no {file}::{name}"

"""bench/ is the top floor: nothing under services/, schemas/, kernels/ or weir/ imports it."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _imports_bench(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in names if n.split(".")[0] == "bench"]
    return found


def test_no_lower_floor_imports_bench() -> None:
    files = [p for floor in ("services", "schemas", "kernels", "weir") for p in sorted((REPO / floor).rglob("*.py"))]
    assert files
    assert [hit for path in files for hit in _imports_bench(path)] == []

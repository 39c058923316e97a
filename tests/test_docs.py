"""The docs are the contract: every invariant the code cites is stated in docs/design.md."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = [
    p
    for d in ("schemas", "kernels", "weir", "services", "bench", "docs", "scripts")
    for p in (REPO / d).rglob("*")
    if p.suffix in (".py", ".md", ".sh")
]


def stated_invariants() -> set[int]:
    text = (REPO / "docs" / "design.md").read_text()
    section = text.split("## Invariants", 1)[1].split("\n## ", 1)[0]
    return {int(n) for n in re.findall(r"^(\d+)\. \*\*", section, re.M)}


def test_every_cited_invariant_is_stated_in_docs_design_md() -> None:
    stated = stated_invariants()
    assert stated == set(range(1, len(stated) + 1)) and len(stated) >= 8
    cited: dict[int, list[str]] = {}
    for path in SOURCES:
        text = " ".join(path.read_text(errors="replace").split())  # a citation may wrap
        for n in re.findall(r"design\.md,? invariants? (\d+)", text) + re.findall(
            r"invariant (\d+) of docs/design\.md", text
        ):
            cited.setdefault(int(n), []).append(str(path.relative_to(REPO)))
    assert cited, "the code cites no invariant"
    assert set(cited) <= stated, {n: where for n, where in cited.items() if n not in stated}


def test_no_citation_points_outside_the_repository() -> None:
    stale = [str(p.relative_to(REPO)) for p in SOURCES if "DESIGN.md" in p.read_text(errors="replace")]
    assert not stale, f"these cite a DESIGN.md that is not in this repository: {stale}"


# `path.py: Name` or `path.py: Class.method` in docs/design.md, "One request, end to end"
_CODE_REF = re.compile(r"`((?:services|weir|schemas|kernels)/[\w/]+\.py): ([A-Za-z_][\w.]*)`")
_BARE_REF = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)`")


def _walk_section() -> str:
    text = (REPO / "docs" / "design.md").read_text()
    assert "\n## One request, end to end\n" in text, "docs/design.md lost its walk of one request"
    return text.split("\n## One request, end to end\n", 1)[1].split("\n## ", 1)[0]


def _defines(path: Path, dotted: str) -> bool:
    """Whether the module at `path` defines `dotted`: a top-level name, or Class.attr (the class's own
    body or a base class of the same module)."""
    import ast

    tree = ast.parse(path.read_text(), str(path))
    top: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            top[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    top[target.id] = node
    head, _, attr = dotted.partition(".")
    if head not in top:
        return False
    if not attr:
        return True
    queue = [top[head]]
    while queue:
        cls = queue.pop()
        if not isinstance(cls, ast.ClassDef):
            continue
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == attr:
                return True
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == attr:
                return True
        queue += [top[b.id] for b in cls.bases if isinstance(b, ast.Name) and b.id in top]
    return False


def test_the_walk_of_one_request_names_only_code_that_exists() -> None:
    """Every module and function the hop tables name exists, so the page cannot go stale: a
    `path.py: name` anywhere in the section, and a bare name in a row's code column, which must be
    defined in a module named in that row or in an earlier one of the table."""
    section = _walk_section()
    rows = [line for line in section.splitlines() if re.match(r"\| \d+ \|", line)]
    assert len(rows) >= 25, "the hop tables lost rows"
    assert "straight to the request topic" in section
    missing: list[str] = []
    named = 0
    for path, name in _CODE_REF.findall(section):
        named += 1
        if not (REPO / path).is_file():
            missing.append(f"{path} (no such file)")
        elif not _defines(REPO / path, name):
            missing.append(f"{path}: {name}")
    seen: list[str] = []  # modules named so far in the table, nearest last
    for row in rows:
        code = row.split(" | ")[2]
        here = [p for p, _ in _CODE_REF.findall(code)]
        seen = [p for p in seen if p not in here] + here
        for bare in _BARE_REF.findall(_CODE_REF.sub("", code)):
            named += 1
            if not any(_defines(REPO / p, bare) for p in here + seen[::-1] if (REPO / p).is_file()):
                missing.append(f"{bare} (row: {row[:60]}...)")
    assert named >= 40, f"only {named} code references: the tables should name the code of every hop"
    where = "docs/design.md, 'One request, end to end'"
    assert not missing, f"{where} names code that does not exist:\n" + "\n".join(missing)

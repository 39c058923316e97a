"""The docs are the contract: every invariant the code cites is stated in docs/design.md."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("schemas", "kernels", "weir", "services", "bench", "docs", "scripts")
           for p in (REPO / d).rglob("*") if p.suffix in (".py", ".md", ".sh")]


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
        for n in re.findall(r"design\.md,? invariants? (\d+)", text) + re.findall(r"invariant (\d+) of docs/design\.md", text):
            cited.setdefault(int(n), []).append(str(path.relative_to(REPO)))
    assert cited, "the code cites no invariant"
    assert set(cited) <= stated, {n: where for n, where in cited.items() if n not in stated}


def test_no_citation_points_outside_the_repository() -> None:
    stale = [str(p.relative_to(REPO)) for p in SOURCES if "DESIGN.md" in p.read_text(errors="replace")]
    assert not stale, f"these cite a DESIGN.md that is not in this repository: {stale}"

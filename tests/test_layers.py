"""The floor plan of docs/design.md ("The floors"), checked on the source: every import points
down, no service imports another, nothing imports bench/, and no import cycle (function-level
imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("schemas", "kernels", "weir", "services", "bench")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_imports(path: Path) -> set[str]:
    """Modules of this project that `path` imports, anywhere in it (function bodies included)."""
    found: set[str] = set()
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name.split(".")[0] in PACKAGES}
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        # `from a.b import c` names a.b.c when c is a module, else a.b
        edges[name] = {imp for imp in project_imports(path) if imp in modules} - {name}
    return edges


def floor(module: str) -> str:
    """services.X for a service, weir.cli for the CLI, else the top package."""
    parts = module.split(".")
    if parts[0] == "services" and len(parts) > 1:
        return f"services.{parts[1]}"
    if module == "weir.cli":
        return "weir.cli"
    return parts[0]


def allowed(src: str, dst: str) -> bool:
    if src == dst:
        return True
    below = {"schemas": set(), "kernels": {"schemas"}, "weir": {"schemas", "kernels"}}
    if src in below:
        return dst in below[src]
    if src.startswith("services."):
        return dst in ("schemas", "kernels", "weir")
    if src == "weir.cli":
        return dst in ("schemas", "kernels", "weir") or dst.startswith("services.")
    return src == "bench"


def test_every_import_points_down() -> None:
    wrong = sorted(
        f"{src} imports {dst}" for src, dsts in graph().items() for dst in dsts if not allowed(floor(src), floor(dst))
    )
    assert not wrong, "\n".join(wrong)


def test_there_is_no_import_cycle() -> None:
    edges = graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)

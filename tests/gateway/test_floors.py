"""The gateway's floor plan: every import between its modules points down (docs/gateway.md)."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[2] / "services" / "gateway"
EDGE = ("services.gateway.app", "services.gateway.routes", "services.gateway.kafka_bus", "services.gateway.streaming")


def gateway_imports() -> dict[str, set[str]]:
    """Module name -> the services.gateway modules it imports (TYPE_CHECKING imports included)."""
    graph: dict[str, set[str]] = {}
    for path in GATEWAY.rglob("*.py"):
        parts = path.relative_to(GATEWAY.parents[1]).with_suffix("").parts
        module = ".".join(parts).removesuffix(".__init__")
        graph[module] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("services.gateway"):
                graph[module].add(str(node.module))
            elif isinstance(node, ast.Import):
                graph[module] |= {a.name for a in node.names if a.name.startswith("services.gateway")}
    return graph


def test_the_gateway_modules_import_each_other_without_a_cycle() -> None:
    graphlib.TopologicalSorter(gateway_imports()).prepare()  # raises CycleError


def test_the_guard_imports_nothing_of_the_edge() -> None:
    up = {
        m: sorted(d for d in deps if d.startswith(EDGE))
        for m, deps in gateway_imports().items()
        if m.startswith("services.gateway.guard")
    }
    assert {m: deps for m, deps in up.items() if deps} == {}


def test_only_the_app_imports_the_routes() -> None:
    up = {
        m: sorted(d for d in deps if d.startswith(("services.gateway.routes", "services.gateway.app")))
        for m, deps in gateway_imports().items()
        if not m.startswith("services.gateway.routes") and m != "services.gateway.app"
    }
    assert {m: deps for m, deps in up.items() if deps} == {}

"""The worker's floor plan: its rooms import each other only downwards (docs/worker.md, "Code layout").

    app.py, models_cli.py      the wiring; `weir models`
    versions.py, loading.py    a version's life: verified, its engines opened, served, drained
    kafka/                     the Kafka edge: batches and cancels in, replies and audit events out
    hosts/                     where an engine runs (process or thread), its device, memory, goldens
    engine/                    the engine core: no Kafka, no clock of its own

config.py is a leaf every floor may read.
"""

from __future__ import annotations

import ast
from pathlib import Path

WORKER = Path(__file__).resolve().parents[2] / "services" / "worker"
FLOORS = ["top", "versions", "kafka", "hosts", "engine"]  # from the top down


def floor(module: str) -> str | None:
    """The floor of a services.worker module (None: config.py, the leaf)."""
    parts = module.split(".")[2:]
    if not parts:
        return "top"
    if parts[0] in ("kafka", "hosts", "engine"):
        return parts[0]
    if parts[0] in ("versions", "loading"):
        return "versions"
    if parts[0] == "config":
        return None
    return "top"


def worker_imports() -> dict[str, set[str]]:
    """Module name -> the services.worker modules it imports (function-level and TYPE_CHECKING
    imports included)."""
    graph: dict[str, set[str]] = {}
    for path in WORKER.rglob("*.py"):
        module = ".".join(path.relative_to(WORKER.parents[1]).with_suffix("").parts).removesuffix(".__init__")
        graph[module] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("services.worker"):
                base = str(node.module)
                graph[module] |= {f"{base}.{a.name}" if base == "services.worker" else base for a in node.names}
            elif isinstance(node, ast.Import):
                graph[module] |= {a.name for a in node.names if a.name.startswith("services.worker")}
    return graph


def test_every_import_between_the_worker_rooms_points_down() -> None:
    up = sorted(
        f"{src} imports {dst}"
        for src, deps in worker_imports().items()
        for dst in deps
        if floor(src) is not None and floor(dst) is not None and FLOORS.index(floor(dst)) < FLOORS.index(floor(src))
    )
    assert up == []


def test_the_floor_plan_knows_every_module() -> None:
    rooms = {path.parent.name for path in WORKER.rglob("*.py") if path.parent != WORKER}
    assert rooms == {"kafka", "hosts", "engine"}, "a new room: give it a floor here and a row in docs/worker.md"

"""Shadow comparisons in the ledger: the `model_comparisons` table, one row of measures per mirrored
request (docs/design.md, "Traffic policies"). No raw text: a row holds what ModelComparison holds.

The running summary per (live version, mirror version) is computed from these rows by the same
function `weir models compare` applies to Topics.comparisons (weir/models/compare.py: summarize),
so the ledger and the topic agree. A redelivered comparison (same request and mirror) is ignored:
the summary never counts a request twice.
"""

from __future__ import annotations

from typing import Any, Literal

from schemas.registry import ModelComparison

COMPARISONS = "model_comparisons"
_TYPES: dict[str, type] = {
    "request_id": str,
    "name": str,
    "live": str,
    "mirror": str,
    "exact_match": bool,
    "token_edit_distance": int,
    "similarity": float,
    "live_ttft_ms": float,
    "mirror_ttft_ms": float,
    "live_tokens_per_s": float,
    "mirror_tokens_per_s": float,
    "mirror_error": str,
    "created_ms": int,
}
_NULLABLE = {"similarity", "live_ttft_ms", "mirror_ttft_ms", "live_tokens_per_s", "mirror_tokens_per_s", "mirror_error"}
assert set(_TYPES) == set(ModelComparison.model_fields) - {"schema_version"}, (
    "ModelComparison changed: update the table"
)
_SQL: dict[str, dict[type, str]] = {
    "sqlite": {int: "INTEGER", float: "REAL", str: "TEXT", bool: "INTEGER"},
    "postgresql": {int: "BIGINT", float: "DOUBLE PRECISION", str: "TEXT", bool: "BOOLEAN"},
}


def tables_sql(dialect: Literal["sqlite", "postgresql"]) -> list[str]:
    """CREATE statements of the comparisons table and its name index (idempotent: the migration of a
    ledger written before it existed)."""
    types = _SQL[dialect]
    cols = ",\n  ".join(f"{name} {types[py]}{'' if name in _NULLABLE else ' NOT NULL'}" for name, py in _TYPES.items())
    return [
        f"CREATE TABLE IF NOT EXISTS {COMPARISONS} (\n  {cols},\n  PRIMARY KEY (request_id, mirror)\n)",
        f"CREATE INDEX IF NOT EXISTS {COMPARISONS}_name ON {COMPARISONS}(name)",
    ]


def insert(store: Any, comparison: ModelComparison) -> bool:
    """Store one comparison; False when it was stored already (a redelivery)."""
    row = comparison.model_dump(include=set(_TYPES))
    names = list(_TYPES)
    cursor = store.execute(
        f"INSERT INTO {COMPARISONS} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))}) "
        "ON CONFLICT (request_id, mirror) DO NOTHING",
        [row[n] for n in names],
    )
    return bool(cursor.rowcount)


def read(store: Any, name: str | None = None) -> list[ModelComparison]:
    """The stored comparisons (of `name`, or all), oldest first."""
    where, params = ("WHERE name = ?", [name]) if name is not None else ("", [])
    rows = store.execute(
        f"SELECT {', '.join(_TYPES)} FROM {COMPARISONS} {where} ORDER BY created_ms", params
    ).fetchall()
    return [ModelComparison(**{**dict(zip(_TYPES, row, strict=True)), "exact_match": bool(row[4])}) for row in rows]

"""`weir audit`: check and read the audit ledger (a file; no Kafka needed).

    weir audit verify [--db PATH]                 exit 0: "OK: N records, chain intact"
                                                  exit 1: "BROKEN at record seq=K (event_id=...): reason"
    weir audit show [--db PATH] [--limit N] [--json]
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path

from services.auditor.config import AuditorSettings
from services.auditor.ledger import Ledger, LedgerError


def build_parser() -> argparse.ArgumentParser:
    """Arguments of `weir audit`."""
    parser = argparse.ArgumentParser(prog="weir audit", description="Check and read the audit ledger.")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    verify = actions.add_parser("verify", help="walk the hash chain; exit 1 at the first broken record")
    show = actions.add_parser("show", help="print the newest records")
    for sub in (verify, show):
        sub.add_argument("--db", type=Path, help="ledger SQLite file (env WEIR_AUDIT_DB; default var/audit.sqlite)")
    show.add_argument("--limit", type=int, default=20, help="how many of the newest records (default %(default)s)")
    show.add_argument("--json", action="store_true", help="print each record's hashed canonical JSON")
    return parser


def main(argv: list[str]) -> int:
    """Run one `weir audit` action; returns the exit status (0 ok, 1 broken chain, 2 unusable file)."""
    args = build_parser().parse_args(argv)
    path = args.db if args.db is not None else AuditorSettings().audit_db
    try:
        ledger = Ledger(path, readonly=True)
    except LedgerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with ledger:
        if args.action == "verify":
            report = ledger.verify()
            print(report.describe())
            return 0 if report.is_ok else 1
        for record in ledger.records(limit=max(args.limit, 0)):
            print(record["canonical_json"] if args.json else _line(record))
    return 0


def _line(record: dict[str, object]) -> str:
    appended = datetime.fromtimestamp(int(record["appended_ms"]) / 1000, UTC)  # type: ignore[call-overload]
    return (
        f"{record['seq']:>6} {appended:%Y-%m-%d %H:%M:%S}Z {record['event_id']} req={record['request_id']} "
        f"{record['model_version']} {record['principal']}@{record['tenant']} {record['finish_reason']} "
        f"tokens={record['prompt_tokens']}+{record['completion_tokens']} "
        f"prompt={str(record['prompt_hmac'])[:12]} output={str(record['output_hmac'])[:12]}"
    )

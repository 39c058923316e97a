"""`weir audit`: check, read and search the audit ledger (a file or database).

    weir audit verify [--db PATH | --dsn DSN] [--bootstrap B] [--topic-prefix P] [--no-anchor]
                                                    exit 0: "OK: N records in C chains, K checkpoints, all intact"
                                                            and "ANCHORS OK: ..." (the ledger matches Kafka's anchors)
                                                    exit 1: "BROKEN ..." / "ANCHORS BROKEN ..." naming what
                                                    exit 2: no ledger, no checkpoint key, or Kafka unreadable

Only verify reads Kafka: the anchor topic (services/auditor/anchors.py), with the checkpoint key
($WEIR_HOME/secrets/audit-checkpoint.key or WEIR_AUDIT_CHECKPOINT_KEY).
    weir audit show [--db PATH | --dsn DSN] [--limit N] [--json]
    weir audit reviews [--db PATH | --dsn DSN] [--principal P] [--limit N] [--json]
    weir audit lookup --text TEXT [--db PATH | --dsn DSN] [--key KEY] [--max-distance BITS] [--json]
    weir audit watermark --text TEXT (--tenant T | --key KEY [--gamma G]) [--model NAME] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

from pydantic import SecretStr

from schemas.fingerprint import parse_key
from schemas.watermark import parse_tenants
from services.auditor.anchors import read_anchor_records
from services.auditor.config import AuditorSettings
from services.auditor.ledger import Ledger, LedgerError
from services.auditor.lookup import DEFAULT_MAX_DISTANCE, lookup


def build_parser() -> argparse.ArgumentParser:
    """Arguments of `weir audit`."""
    parser = argparse.ArgumentParser(prog="weir audit", description="Check, read and search the audit ledger.")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    verify = actions.add_parser(
        "verify", help="walk every chain and checkpoint, check them against Kafka's anchors; exit 1 if one is broken"
    )
    show = actions.add_parser("show", help="print the newest records")
    reviews = actions.add_parser("reviews", help="print the newest review flags (principals to review)")
    find = actions.add_parser("lookup", help="records whose prompt or output is this text, exactly or nearly")
    mark = actions.add_parser("watermark", help="z-score and p-value of a tenant's watermark in a text")
    for sub in (verify, show, reviews, find):
        sub.add_argument(
            "--db", type=Path, help="ledger SQLite file (env WEIR_AUDIT_DB; default $WEIR_HOME/audit.sqlite)"
        )
        sub.add_argument("--dsn", help="ledger PostgreSQL DSN (env WEIR_AUDIT_DSN); replaces --db")
    verify.add_argument("--bootstrap", help="Kafka bootstrap servers of the anchors (env WEIR_KAFKA_BOOTSTRAP)")
    verify.add_argument("--topic-prefix", help="the deployment's topic prefix (env WEIR_TOPIC_PREFIX)")
    verify.add_argument(
        "--anchor-timeout", type=float, default=30.0, help="seconds to wait for Kafka (default %(default)s)"
    )
    verify.add_argument(
        "--no-anchor",
        action="store_true",
        help="check the database alone: a truncated tail, or a rewrite with the key, go unseen",
    )
    show.add_argument("--limit", type=int, default=20, help="how many of the newest records (default %(default)s)")
    show.add_argument("--json", action="store_true", help="print each record's hashed canonical JSON")
    reviews.add_argument("--principal", help="only this principal's flags")
    reviews.add_argument("--limit", type=int, default=20, help="how many of the newest flags (default %(default)s)")
    reviews.add_argument("--json", action="store_true", help="print each flag's hashed canonical JSON")
    find.add_argument("--text", required=True, help="the text asked about")
    find.add_argument(
        "--key",
        help="fingerprint key, 'hex:...' or text (default: env WEIR_AUDIT_HMAC_KEY, else "
        "the deployment's $WEIR_HOME/secrets/audit-hmac.key)",
    )
    find.add_argument(
        "--max-distance",
        type=int,
        default=DEFAULT_MAX_DISTANCE,
        help="most SimHash bits a semantic match differs by (default %(default)s)",
    )
    find.add_argument("--exact", action="store_true", help="exact matches only (no embedding model needed)")
    find.add_argument("--json", action="store_true", help="one JSON object per match")
    mark.add_argument("--text", required=True, help="the text to test")
    mark.add_argument("--tenant", help="tenant whose watermark to test for (env WEIR_WATERMARK_TENANTS)")
    mark.add_argument("--key", help="or the watermark key itself, 'hex:...' or text")
    mark.add_argument("--gamma", type=float, help="green fraction with --key (default 0.25)")
    mark.add_argument("--model", help="model whose tokenizer to use (default: the repository's first)")
    mark.add_argument("--json", action="store_true")
    return parser


def main(argv: list[str]) -> int:
    """Run one `weir audit` action; returns the exit status (0 ok, 1 broken chain, 2 unusable input)."""
    args = build_parser().parse_args(argv)
    settings = AuditorSettings()
    if args.action == "watermark":
        return _watermark(args, settings)
    if getattr(args, "dsn", None):
        settings = settings.model_copy(update={"audit_dsn": SecretStr(args.dsn)})
    elif args.db is not None:
        settings = settings.model_copy(update={"audit_dsn": None, "audit_db": args.db})
    if args.action == "verify":
        return _verify(args, settings)
    try:
        ledger = Ledger(settings.ledger_target(), readonly=True)
    except LedgerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with ledger:
        if args.action == "lookup":
            return _lookup(args, settings, ledger)
        if args.action == "reviews":
            for flag in ledger.review_flags.rows(limit=max(args.limit, 0), principal=args.principal):
                print(flag["canonical_json"] if args.json else _flag_line(flag))
            return 0
        for record in ledger.records(limit=max(args.limit, 0)):
            print(record["canonical_json"] if args.json else _line(record))
    return 0


def _verify(args: argparse.Namespace, settings: AuditorSettings) -> int:
    """The ledger's chains and checkpoints (their MACs), then, unless --no-anchor, the ledger
    against the anchors in Kafka, read first (docs/design.md, "The audit chain")."""
    if args.no_anchor and (args.bootstrap or args.topic_prefix):
        print(
            "error: --bootstrap and --topic-prefix say where the anchors are, and --no-anchor skips them",
            file=sys.stderr,
        )
        return 2
    updates = {"kafka_bootstrap": args.bootstrap, "topic_prefix": args.topic_prefix}
    settings = settings.model_copy(update={k: v for k, v in updates.items() if v is not None})
    try:
        key = settings.checkpoint_key(create=False)
        ledger = Ledger(settings.ledger_target(), readonly=True, checkpoint_key=key)
    except (ValueError, LedgerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with ledger:
        if args.no_anchor:
            report = ledger.verify()
            print(report.describe())
            print(
                "ANCHORS NOT CHECKED (--no-anchor): a truncated tail, or a rewrite by the key's holder, would not show"
            )
            return 0 if report.is_ok else 1
        topic = settings.topics.audit_anchors
        try:
            records = asyncio.run(read_anchor_records(settings.kafka_bootstrap, topic, args.anchor_timeout))
        except Exception as exc:  # noqa: BLE001 - any failure to read Kafka is "cannot check"
            print(
                f"error: cannot read the anchors ({topic}) from Kafka at {settings.kafka_bootstrap}: "
                f"{exc or type(exc).__name__}; --no-anchor checks the database alone",
                file=sys.stderr,
            )
            return 2
        report, anchors = ledger.verify_with_anchors(topic, records)
    print(report.describe())
    print(anchors.describe())
    return 0 if report.is_ok and anchors.is_ok else 1


def _lookup(args: argparse.Namespace, settings: AuditorSettings, ledger: Ledger) -> int:
    try:
        key = parse_key(args.key) if args.key else settings.hmac_key(create=False)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    simhash = None
    if not args.exact:
        from services.auditor.fingerprints import simhash_function

        simhash = simhash_function(settings.model_repo)(args.text)
        if simhash is None:
            print("note: no fingerprint model here; exact matches only", file=sys.stderr)
    matches = lookup(ledger, key, args.text, simhash=simhash, max_distance=args.max_distance)
    for m in matches:
        if args.json:
            print(json.dumps(m.as_dict()))
        else:
            finished = datetime.fromtimestamp(m.finished_ms / 1000, UTC)
            print(
                f"{m.match:<8} {m.field:<6} distance={m.distance:<2} chain={m.chain_id} seq={m.seq} "
                f"{finished:%Y-%m-%d %H:%M:%S}Z req={m.request_id} {m.model_version} {m.principal}@{m.tenant}"
            )
    if not args.json:
        print(f"{len(matches)} match(es)")
    return 0


def _watermark(args: argparse.Namespace, settings: AuditorSettings) -> int:
    from services.auditor.watermark import WatermarkDetector

    try:
        detector = WatermarkDetector(settings.model_repo, parse_tenants(settings.watermark_tenants))
        found = detector.detect(
            args.text,
            tenant=args.tenant,
            key=parse_key(args.key) if args.key else None,
            gamma=args.gamma,
            model=args.model,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(found.as_dict()))
    else:
        print(
            f"z={found.z_score:.2f} p={found.p_value:.3g} green={found.num_green}/{found.num_scored} scored "
            f"of {found.num_tokens} tokens"
        )
    return 0


def _line(record: dict[str, object]) -> str:
    appended = datetime.fromtimestamp(int(record["appended_ms"]) / 1000, UTC)  # type: ignore[call-overload]  # the ledger's JSON: an int
    return (
        f"{record['chain_id']:>3}:{record['seq']:<6} {appended:%Y-%m-%d %H:%M:%S}Z {record['event_id']} "
        f"req={record['request_id']} {record['model_version']} {record['principal']}@{record['tenant']} "
        f"{record['finish_reason']} tokens={record['prompt_tokens']}+{record['completion_tokens']} "
        f"prompt={str(record['prompt_hmac'])[:12]} output={str(record['output_hmac'])[:12]}"
    )


def _flag_line(flag: dict[str, object]) -> str:
    """One review flag: when it was raised, who, how many detections in what window, which rules."""
    created = datetime.fromtimestamp(int(flag["created_ms"]) / 1000, UTC)  # type: ignore[call-overload]  # the ledger's JSON: an int
    rules = ",".join(json.loads(str(flag["rules"]))) or "-"
    return (
        f"{created:%Y-%m-%d %H:%M:%S}Z {flag['principal']}@{flag['tenant']} {flag['reason']} "
        f"detections={flag['num_detections']} window={flag['window_s']}s rules={rules} "
        f"gateway={flag['gateway_id']} flag={flag['flag_id']} chain={flag['chain_id']} seq={flag['seq']}"
    )

"""Token usage and cost as `<prefix>.usage.tokens` holds them, and `weir usage` that prints them.

The auditor is the only bookkeeper (docs/design.md, "Observability"): it folds the audit stream
into UsageTotals per (day, tenant, principal, model version) and RateCards per model version on
that compacted topic. A reader keeps the latest record of each key (UsageBook), as the gateway's
GET /v1/usage does (services/gateway/usage.py) and this module's CLI does from one read:

    weir usage [--tenant T] [--day YYYY-MM-DD] [--json]

A record that is not a UsageTotals or RateCard, or whose Kafka key is not its own key(), is
skipped and counted (docs/design.md, invariant 6): a forged record cannot stand in for another
key's totals.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import orjson
from aiokafka.errors import KafkaError

from schemas.codec import DecodeError, decode
from schemas.telemetry import RateCard, UsageTotals

GROUPS = ("day", "tenant", "principal", "model")  # what rows may be grouped by; all four: one row per key
_DAY = re.compile(r"\d{4}-\d{2}-\d{2}")
_SUMMED = ("requests", "prompt_tokens", "completion_tokens", "cached_prompt_tokens")


class UsageBook:
    """The latest UsageTotals per key and RateCard per model version of the token usage topic."""

    def __init__(self) -> None:
        self.totals: dict[str, UsageTotals] = {}
        self.rates: dict[str, RateCard] = {}
        self.num_skipped = 0

    def apply(self, key: bytes | None, value: bytes | None) -> str | None:
        """Fold one record (a tombstone deletes its key); returns why it was skipped, or None."""
        reason = self._apply(key, value)
        if reason is not None:
            self.num_skipped += 1
        return reason

    def _apply(self, key: bytes | None, value: bytes | None) -> str | None:
        if key is None:
            return "no key"
        name = key.decode(errors="replace")
        if value is None:
            self.totals.pop(name, None)
            self.rates.pop(name, None)
            return None
        try:
            record = decode_usage_record(value)
        except DecodeError as exc:
            return str(exc)
        if record.key() != name:
            return f"key {name[:80]!r} is not the record's own ({record.key()[:80]!r})"
        if isinstance(record, RateCard):
            self.rates[name] = record
        else:
            self.totals[name] = record
        return None

    def rows(
        self,
        tenant: str | None = None,
        start: str | None = None,
        end: str | None = None,
        group_by: Sequence[str] = GROUPS,
    ) -> list[dict[str, Any]]:
        """Rows of the totals of `tenant` (None: all) from day `start` to day `end` (inclusive, None:
        open), summed per distinct value of the `group_by` fields, sorted by them."""
        picked = [
            t
            for t in self.totals.values()
            if (tenant is None or t.tenant == tenant)
            and (start is None or t.day >= start)
            and (end is None or t.day <= end)
        ]
        return summed_rows(picked, group_by)

    def rate_cards(self) -> list[dict[str, Any]]:
        """Every model version's latest RateCard, by model version."""
        return [card.model_dump(mode="json") for _, card in sorted(self.rates.items())]


def decode_usage_record(value: bytes) -> UsageTotals | RateCard:
    """A record of the token usage topic by its `kind` ("usage" or "rate"); DecodeError otherwise."""
    try:
        kind = orjson.loads(value).get("kind")
    except (orjson.JSONDecodeError, AttributeError):
        raise DecodeError("not a JSON object") from None
    if kind == "rate":
        return decode(RateCard, value)
    if kind == "usage":
        return decode(UsageTotals, value)
    raise DecodeError(f"kind must be 'usage' or 'rate', not {str(kind)[:40]!r}")


def summed_rows(totals: Iterable[UsageTotals], group_by: Sequence[str] = GROUPS) -> list[dict[str, Any]]:
    """The totals summed per distinct value of `group_by` (a subset of GROUPS). A row's cost_usd is
    None when any of its totals has no price: a partial sum would understate it."""
    unknown = [g for g in group_by if g not in GROUPS]
    if unknown:
        raise ValueError(f"cannot group by {unknown[0]!r}; choose from {', '.join(GROUPS)}")
    rows: dict[tuple[str, ...], dict[str, Any]] = {}
    for t in totals:
        fields = {"day": t.day, "tenant": t.tenant, "principal": t.principal, "model": t.model_version}
        group = tuple(fields[g] for g in GROUPS if g in group_by)
        row = rows.setdefault(
            group, {**{g: fields[g] for g in GROUPS if g in group_by}, **dict.fromkeys(_SUMMED, 0), "cost_usd": 0.0}
        )
        for name in _SUMMED:
            row[name] += getattr(t, name)
        row["cost_usd"] = None if row["cost_usd"] is None or t.cost_usd is None else row["cost_usd"] + t.cost_usd
    out = [rows[group] for group in sorted(rows)]
    for row in out:
        row["total_tokens"] = row["prompt_tokens"] + row["completion_tokens"]
    return out


def check_day(value: str | None, name: str) -> str | None:
    """`value` when it is a YYYY-MM-DD day (or None); ValueError naming `name` otherwise."""
    if value is not None:
        try:
            if not _DAY.fullmatch(value):
                raise ValueError
            datetime.date.fromisoformat(value)  # a real day: not 2026-13-45
        except ValueError:
            raise ValueError(f"{name} must be a day, YYYY-MM-DD") from None
    return value


# -- weir usage ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weir usage",
        description="Token usage and cost per day, tenant, "
        "principal and model version, as the auditor counted them from the audit log.",
    )
    parser.add_argument("--tenant", help="only this tenant")
    parser.add_argument("--day", help="only this UTC day, YYYY-MM-DD")
    parser.add_argument("--json", action="store_true", help='one JSON object: {"data": rows, "rate_cards": [...]}')
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (env WEIR_KAFKA_BOOTSTRAP)")
    parser.add_argument("--topic-prefix", help="topic name prefix (env WEIR_TOPIC_PREFIX)")
    return parser


def render_table(rows: list[dict[str, Any]], cards: list[dict[str, Any]]) -> str:
    """The rows and rate cards as plain-text tables."""
    lines = [
        f"{'DAY':<10}  {'TENANT':<16} {'PRINCIPAL':<20} {'MODEL':<28} {'REQUESTS':>8} {'PROMPT':>10} "
        f"{'CACHED':>8} {'COMPLETION':>10} {'COST USD':>10}"
    ]
    for row in rows:
        cost = "-" if row["cost_usd"] is None else f"{row['cost_usd']:.6f}"
        lines.append(
            f"{row['day']:<10}  {row['tenant'][:16]:<16} {row['principal'][:20]:<20} {row['model'][:28]:<28} "
            f"{row['requests']:>8} {row['prompt_tokens']:>10} {row['cached_prompt_tokens']:>8} "
            f"{row['completion_tokens']:>10} {cost:>10}"
        )
    if cards:
        lines += ["", f"{'MODEL':<28} {'TOKENS/HOUR':>12} {'HW USD/HOUR':>12} {'USD/1M TOKENS':>14}"]
        for card in cards:
            hardware = (
                "-" if card["hardware_cost_per_hour_usd"] is None else f"{card['hardware_cost_per_hour_usd']:.2f}"
            )
            per_1m = "-" if card["cost_per_1m_tokens_usd"] is None else f"{card['cost_per_1m_tokens_usd']:.4f}"
            lines.append(
                f"{card['model_version'][:28]:<28} {card['tokens_per_hour']:>12.0f} {hardware:>12} {per_1m:>14}"
            )
    return "\n".join(lines)


async def _read_book(args: argparse.Namespace) -> UsageBook:
    from weir.bus import BusSettings, read_topic

    overrides = {"kafka_bootstrap": args.bootstrap, "topic_prefix": args.topic_prefix}
    settings = BusSettings(**{k: v for k, v in overrides.items() if v is not None})
    book = UsageBook()
    for key, value in await read_topic(settings, settings.topics.token_usage, client_id="weir-usage"):
        book.apply(key, value)
    return book


def main(argv: list[str]) -> int:
    """`weir usage`: 0 printed, 2 bad arguments or no broker/topic."""
    args = build_parser().parse_args(argv)
    try:
        day = check_day(args.day, "--day")
        book = asyncio.run(_read_book(args))
    except ValueError as exc:
        print(f"weir usage: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError, KafkaError) as exc:  # no such topic, no broker
        print(f"weir usage: cannot read the usage topic: {exc}", file=sys.stderr)
        return 2
    rows = book.rows(tenant=args.tenant, start=day, end=day)
    cards = book.rate_cards()
    if args.json:
        print(orjson.dumps({"data": rows, "rate_cards": cards, "skipped": book.num_skipped}).decode())
    else:
        print(render_table(rows, cards))
        if book.num_skipped:
            print(f"({book.num_skipped} unreadable record(s) of the usage topic skipped)", file=sys.stderr)
    return 0

"""weir.usage: the reader's fold of the token usage topic (latest per key, tombstones, forged keys
skipped), rows summed per group, and `weir usage`'s table."""

from __future__ import annotations

import pytest

from schemas.codec import encode
from schemas.telemetry import RateCard, UsageTotals
from weir.usage import UsageBook, render_table


def _totals(day: str, tenant: str, principal: str, requests: int, cost: float | None = 0.5) -> UsageTotals:
    return UsageTotals(
        day=day,
        tenant=tenant,
        principal=principal,
        model_version="m@1",
        requests=requests,
        prompt_tokens=10 * requests,
        completion_tokens=requests,
        cached_prompt_tokens=requests,
        cost_usd=cost,
    )


def _apply(book: UsageBook, record: UsageTotals | RateCard) -> str | None:
    return book.apply(record.key().encode(), encode(record))


def test_latest_per_key_wins_tombstones_delete_and_forgeries_are_skipped() -> None:
    book = UsageBook()
    first = _totals("2026-01-01", "acme", "ann", 1)
    assert _apply(book, first) is None and _apply(book, _totals("2026-01-01", "acme", "ann", 3)) is None
    assert [row["requests"] for row in book.rows()] == [3]
    assert "not the record's own" in book.apply(b"usage\x1fother", encode(first))
    assert book.apply(None, encode(first)) == "no key"
    assert book.apply(b"rate:m@1", b'{"kind": "bill"}') is not None
    assert book.apply(b"x", b"[1, 2]") == "not a JSON object"
    assert book.num_skipped == 4 and [row["requests"] for row in book.rows()] == [3]
    assert book.apply(first.key().encode(), None) is None and book.rows() == []  # a tombstone


def test_rows_are_filtered_and_summed_per_group_and_an_unpriced_part_makes_the_cost_unknown() -> None:
    book = UsageBook()
    for record in (
        _totals("2026-01-01", "acme", "ann", 1),
        _totals("2026-01-02", "acme", "bob", 2),
        _totals("2026-01-02", "globex", "eve", 4, cost=None),
    ):
        _apply(book, record)
    by_tenant = book.rows(group_by=["tenant"])
    assert [(r["tenant"], r["requests"], r["prompt_tokens"], r["total_tokens"], r["cost_usd"]) for r in by_tenant] == [
        ("acme", 3, 30, 33, 1.0),
        ("globex", 4, 40, 44, None),
    ]
    assert [r["principal"] for r in book.rows(tenant="acme", start="2026-01-02")] == ["bob"]
    assert book.rows(end="2026-01-01")[0]["day"] == "2026-01-01"
    (everything,) = book.rows(group_by=["model"])
    assert everything["requests"] == 7 and everything["cost_usd"] is None
    with pytest.raises(ValueError, match="colour"):
        book.rows(group_by=["colour"])


def test_the_table_shows_rows_and_rate_cards() -> None:
    book = UsageBook()
    _apply(book, _totals("2026-01-01", "acme", "ann", 2))
    _apply(
        book,
        RateCard(
            model_version="m@1",
            tokens_per_hour=1200,
            window_s=3600,
            hardware_cost_per_hour_usd=2.0,
            cost_per_1m_tokens_usd=2.0 / 1200 * 1e6,
        ),
    )
    table = render_table(book.rows(), book.rate_cards()).splitlines()
    assert table[1].split() == ["2026-01-01", "acme", "ann", "m@1", "2", "20", "2", "2", "0.500000"]
    assert table[-1].split() == ["m@1", "1200", "2.00", "1666.6667"]

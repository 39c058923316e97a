"""The auditor's token accounting (services/auditor/usage.py), folded from a real SQLite ledger:
a redelivered event counts once, a mirror copy is not billed, the day is the UTC day of
finished_ms, prices give cost_usd, a restarted auditor republishes from its records, and rate
cards come from the tokens served over the window."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from schemas.codec import decode
from schemas.telemetry import RateCard, UsageTotals
from services.auditor.ledger import Ledger
from services.auditor.usage import Price, UsageAccounts, UsageLedger, load_prices

from .factories import make_event

KEY = b"usage-checkpoint-key-0123456789ab"
MIDNIGHT_MS = 1_700_006_400_000  # 2023-11-15T00:00:00Z
PRICES = {
    "weir-tiny": Price(input_per_1m=1.0, output_per_1m=3.0),
    "weir-tiny@2": Price(input_per_1m=0.5, output_per_1m=0.5),
}


class Sync(UsageLedger):
    """The UsageLedger protocol over a Ledger in this thread (the app runs it on the ledger thread)."""

    def __init__(self, ledger: Ledger) -> None:
        async def usage_of(key):
            return ledger.usage_of(key)

        async def keys_since(ms):
            return ledger.usage_keys_since(ms)

        async def served(ms):
            return ledger.tokens_served_since(ms)

        super().__init__(usage_of, keys_since, served)


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    with Ledger(tmp_path / "audit.sqlite", checkpoint_key=KEY) as ledger:
        yield ledger


def accounts_of(ledger: Ledger, sent: dict[bytes, bytes], **kwargs) -> UsageAccounts:
    async def publish(key: bytes, value: bytes) -> None:
        sent[key] = value  # a compacted topic: the latest per key

    return UsageAccounts(
        Sync(ledger),
        kwargs.pop("prices", PRICES),
        publish,
        kwargs.pop("hardware", None),
        kwargs.pop("window_s", 3600.0),
    )


def totals(sent: dict[bytes, bytes]) -> dict[tuple[str, str, str], UsageTotals]:
    out = {}
    for value in sent.values():
        if b'"kind":"usage"' in value:
            t = decode(UsageTotals, value)
            out[(t.day, t.principal, t.model_version)] = t
    return out


async def test_each_event_counts_once_mirrors_are_not_billed_and_days_are_utc(ledger: Ledger) -> None:
    sent: dict[bytes, bytes] = {}
    accounts = accounts_of(ledger, sent)
    events = [
        make_event(1, principal="ann", finished_ms=MIDNIGHT_MS - 1, prompt_tokens=10, completion_tokens=20),
        make_event(
            2, principal="ann", finished_ms=MIDNIGHT_MS, prompt_tokens=7, completion_tokens=3, cached_prompt_tokens=4
        ),
        make_event(3, principal="ann", finished_ms=MIDNIGHT_MS + 5, prompt_tokens=1, completion_tokens=1),
        make_event(
            4,
            principal="ann",
            finished_ms=MIDNIGHT_MS + 6,
            shadow_of="req-3",
            prompt_tokens=99,
            completion_tokens=99,
            model_version="weir-tiny@2",
        ),
        make_event(
            5,
            principal="bob",
            finished_ms=MIDNIGHT_MS + 7,
            model_version="weir-tiny@2",
            prompt_tokens=1_000_000,
            completion_tokens=1_000_000,
        ),
    ]
    for offset, event in enumerate([*events, events[1]]):  # the last: a redelivery
        ledger.append(event, partition=0, offset=offset)
        accounts.observe(event)  # the app observes new events only; a stray repeat must not count either
    assert await accounts.publish_touched() == 3
    got = totals(sent)
    assert set(got) == {
        ("2023-11-14", "ann", "weir-tiny@1"),
        ("2023-11-15", "ann", "weir-tiny@1"),
        ("2023-11-15", "bob", "weir-tiny@2"),
    }  # no key of the mirror copy
    before, after = got[("2023-11-14", "ann", "weir-tiny@1")], got[("2023-11-15", "ann", "weir-tiny@1")]
    assert (before.requests, before.prompt_tokens, before.completion_tokens) == (1, 10, 20)
    assert (after.requests, after.prompt_tokens, after.completion_tokens, after.cached_prompt_tokens) == (2, 8, 4, 4)
    assert before.cost_usd == pytest.approx((10 * 1.0 + 20 * 3.0) / 1e6)  # the name's price
    assert got[("2023-11-15", "bob", "weir-tiny@2")].cost_usd == pytest.approx(1.0)  # the version's own price
    assert after.key().encode() in sent and after.tenant == "default"
    assert accounts.touched == set() and await accounts.publish_touched() == 0


async def test_no_price_is_no_cost_and_a_failed_publish_is_retried(ledger: Ledger) -> None:
    sent: dict[bytes, bytes] = {}
    failing = True

    async def publish(key: bytes, value: bytes) -> None:
        if failing:
            raise ConnectionError("broker away")
        sent[key] = value

    accounts = UsageAccounts(Sync(ledger), {}, publish, None, 3600.0)
    event = make_event(1, finished_ms=MIDNIGHT_MS)
    ledger.append(event, partition=0, offset=0)
    accounts.observe(event)
    with pytest.raises(ConnectionError):
        await accounts.publish_touched()
    assert len(accounts.touched) == 1  # kept for the next tick
    failing = False
    assert await accounts.publish_touched() == 1
    (only,) = totals(sent).values()
    assert only.cost_usd is None and only.requests == 1


async def test_a_restarted_auditor_republishes_recent_days_from_its_ledger(tmp_path: Path) -> None:
    path = tmp_path / "audit.sqlite"
    now = MIDNIGHT_MS + 3600_000
    with Ledger(path, checkpoint_key=KEY) as ledger:
        for i, finished in enumerate((MIDNIGHT_MS - 10, MIDNIGHT_MS + 10, MIDNIGHT_MS - 3 * 86_400_000)):
            ledger.append(make_event(i, principal="ann", finished_ms=finished), partition=0, offset=i)
    sent: dict[bytes, bytes] = {}
    with Ledger(path, checkpoint_key=KEY) as ledger:  # nothing observed since the restart
        accounts = accounts_of(ledger, sent)
        await accounts.restate(now)
        await accounts.publish_touched()
    assert sorted(day for day, _, _ in totals(sent)) == ["2023-11-14", "2023-11-15"]  # not the day 3 days ago


async def test_rate_cards_from_tokens_served_over_the_window(ledger: Ledger) -> None:
    sent: dict[bytes, bytes] = {}
    now = MIDNIGHT_MS + 7200_000
    accounts = accounts_of(ledger, sent, hardware=2.0, window_s=3600.0)
    ledger.append(make_event(1, finished_ms=now - 10, prompt_tokens=300, completion_tokens=700), 0, 0)
    ledger.append(
        make_event(
            2,
            finished_ms=now - 20,
            prompt_tokens=0,
            completion_tokens=1000,
            shadow_of="req-9",
            model_version="weir-tiny@2",
        ),
        0,
        1,
    )  # hardware ran it
    ledger.append(make_event(3, finished_ms=now - 3600_001, prompt_tokens=5, completion_tokens=5), 0, 2)  # too old
    cards = {card.model_version: card for card in await accounts.publish_rates(now)}
    assert cards["weir-tiny@1"].tokens_per_hour == 1000 and cards["weir-tiny@2"].tokens_per_hour == 1000
    assert cards["weir-tiny@1"].cost_per_1m_tokens_usd == pytest.approx(2.0 / 1000 * 1e6)
    assert decode(RateCard, sent[b"rate:weir-tiny@1"]).hardware_cost_per_hour_usd == 2.0
    # an hour later nothing was served: each version gets a last card of 0 tokens, no cost, then none
    later = {card.model_version: card for card in await accounts.publish_rates(now + 3600_000)}
    assert later["weir-tiny@1"].tokens_per_hour == 0 and later["weir-tiny@1"].cost_per_1m_tokens_usd is None
    assert await accounts.publish_rates(now + 3600_000) == []


def test_prices_come_from_the_model_repository(tmp_path: Path) -> None:
    repo = tmp_path / "models.toml"
    repo.write_text(
        '[models.a]\nengine = "echo"\n\n[prices.a]\ninput_per_1m = 0.1\noutput_per_1m = 0.4\n\n'
        '[prices."a@2"]\ninput_per_1m = 1\noutput_per_1m = 2\n'
    )
    assert load_prices(repo) == {
        "a": Price(input_per_1m=0.1, output_per_1m=0.4),
        "a@2": Price(input_per_1m=1, output_per_1m=2),
    }
    repo.write_text("[prices.a]\ninput_per_1m = -1\noutput_per_1m = 0\n")
    with pytest.raises(ValueError, match=r"\[prices.a\] is invalid"):
        load_prices(repo)
    repo.write_text("[prices.a]\ninput_per_1m = 1\noutput_per_1m = 0\nper_request = 2\n")
    with pytest.raises(ValueError, match="per_request"):
        load_prices(repo)

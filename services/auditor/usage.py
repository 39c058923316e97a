"""Token accounting: the auditor folds its ledger into UsageTotals and RateCards on the compacted
`<prefix>.usage.tokens` (docs/design.md, "Observability": the auditor is the only bookkeeper).

Each new AuditEvent marks its key (UTC day of finished_ms, tenant, principal, model version)
touched; a timer recomputes the touched keys' totals from the ledger (Ledger.usage_of) and
publishes them. Counting from the ledger rather than adding events up in memory is what makes a
redelivered event count once (the ledger stores one record per event_id) and a restarted auditor
right (it starts from its records, and republishes the keys of the last USAGE_RESTATE_DAYS, so
totals stored but not yet published before a crash go out). Mirror copies (shadow_of) are not
billed.

Prices come from the model repository's `[prices.<name>]` or `[prices."<name>@<version>"]`
tables (`input_per_1m`, `output_per_1m`, USD per million tokens; the version's own entry first):
a price is not part of what a version is, so it sits beside `[models.*]`, not in the entry whose
fields go into the signed manifest. A version with no price gets cost_usd None.

Rate cards: every `usage_rate_every_s` each model version's tokens served (prompt + completion,
mirror copies included: the hardware ran them) over the last `usage_rate_window_s` give its
tokens per hour, and with WEIR_HARDWARE_COST_PER_HOUR its cost per 1M tokens. The card assumes the
version has the hardware to itself; with several versions on one machine each card's cost is an
upper bound.
"""

from __future__ import annotations

import logging
import tomllib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from schemas.codec import encode
from schemas.messages import AuditEvent, now_ms
from schemas.telemetry import RateCard, UsageTotals
from services.auditor.ledger import DAY_MS, UsageKey

log = logging.getLogger(__name__)

USAGE_RESTATE_DAYS = 2  # keys republished at start: today and yesterday (UTC)
Publish = Callable[[bytes, bytes], Awaitable[None]]  # (key, value) onto the token usage topic


class Price(BaseModel):
    """One `[prices.*]` table: USD per million input (prompt) and output (completion) tokens."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input_per_1m: float = Field(ge=0)
    output_per_1m: float = Field(ge=0)

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (prompt_tokens * self.input_per_1m + completion_tokens * self.output_per_1m) / 1e6


def load_prices(repo: str | Path) -> dict[str, Price]:
    """The `[prices.*]` tables of the model repository file, by model name or name@version ({}
    when it has none). ValueError naming the table when one is malformed."""
    raw = tomllib.loads(Path(repo).read_text()).get("prices", {})
    if not isinstance(raw, dict):
        raise ValueError(f"{repo}: prices must be a table of [prices.<model>] tables")
    prices = {}
    for name, table in raw.items():
        try:
            prices[name] = Price.model_validate(table)
        except ValidationError as exc:
            raise ValueError(
                f"{repo}: [prices.{name}] is invalid: {exc.errors()[0]['msg']} "
                f"({'.'.join(map(str, exc.errors()[0]['loc'])) or 'table'})"
            ) from exc
    return prices


def price_of(prices: dict[str, Price], model_version: str) -> Price | None:
    """The version's own price, else its model name's, else None."""
    return prices.get(model_version) or prices.get(model_version.partition("@")[0])


def usage_key(event: AuditEvent) -> UsageKey | None:
    """The key an event counts under; None for a mirror copy (not billed)."""
    if event.shadow_of is not None:
        return None
    return event.finished_ms // DAY_MS, event.tenant, event.principal, event.model_version


def day_of(epoch_day: int) -> str:
    """YYYY-MM-DD of a day counted from the epoch (UTC)."""
    return datetime.fromtimestamp(epoch_day * DAY_MS / 1000, UTC).strftime("%Y-%m-%d")


def totals_of(key: UsageKey, counts: tuple[int, int, int, int], prices: dict[str, Price]) -> UsageTotals:
    """The UsageTotals of `key` from its ledger counts (Ledger.usage_of), priced."""
    epoch_day, tenant, principal, model_version = key
    requests, prompt, completion, cached = counts
    price = price_of(prices, model_version)
    return UsageTotals(
        day=day_of(epoch_day),
        tenant=tenant,
        principal=principal,
        model_version=model_version,
        requests=requests,
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_prompt_tokens=cached,
        cost_usd=None if price is None else price.cost(prompt, completion),
    )


def rate_card(model_version: str, tokens: int, window_s: float, hardware_cost_per_hour: float | None) -> RateCard:
    """A version's RateCard from the tokens it served over `window_s`; no cost per 1M tokens
    without a hardware cost or when it served none."""
    per_hour = tokens * 3600 / window_s
    per_1m = None if hardware_cost_per_hour is None or per_hour == 0 else hardware_cost_per_hour / per_hour * 1e6
    return RateCard(
        model_version=model_version,
        tokens_per_hour=per_hour,
        window_s=window_s,
        hardware_cost_per_hour_usd=hardware_cost_per_hour,
        cost_per_1m_tokens_usd=per_1m,
    )


@dataclass
class UsageLedger:
    """What UsageAccounts reads of the ledger (LedgerWriter's methods, on its thread)."""

    usage_of: Callable[[UsageKey], Awaitable[tuple[int, int, int, int]]]
    usage_keys_since: Callable[[int], Awaitable[list[UsageKey]]]
    tokens_served_since: Callable[[int], Awaitable[dict[str, int]]]


class UsageAccounts:
    """The touched keys and what is published for them; the app's timers call publish_touched and
    publish_rates (services/auditor/app.py)."""

    def __init__(
        self,
        ledger: UsageLedger,
        prices: dict[str, Price],
        publish: Publish,
        hardware_cost_per_hour: float | None,
        rate_window_s: float,
    ) -> None:
        self.ledger = ledger
        self.prices = prices
        self.publish = publish
        self.hardware_cost_per_hour = hardware_cost_per_hour
        self.rate_window_s = rate_window_s
        self.touched: set[UsageKey] = set()
        self._carded: set[str] = set()  # versions with a card out: one that goes quiet gets a last card of 0

    def observe(self, event: AuditEvent) -> None:
        """A new event is in the ledger: its key's totals are due."""
        if (key := usage_key(event)) is not None:
            self.touched.add(key)

    async def restate(self, now: int | None = None) -> None:
        """Mark the keys of the last USAGE_RESTATE_DAYS touched (at start: see the module doc)."""
        since = ((now_ms() if now is None else now) // DAY_MS - USAGE_RESTATE_DAYS + 1) * DAY_MS
        self.touched.update(await self.ledger.usage_keys_since(since))

    async def publish_touched(self) -> int:
        """Recompute and publish the touched keys' totals; a key whose publish fails stays touched."""
        keys, self.touched = self.touched, set()
        sent = 0
        try:
            for key in sorted(keys):
                totals = totals_of(key, await self.ledger.usage_of(key), self.prices)
                await self.publish(totals.key().encode(), encode(totals))
                keys.discard(key)
                sent += 1
        finally:
            self.touched |= keys
        return sent

    async def publish_rates(self, now: int | None = None) -> list[RateCard]:
        """Publish every recently active version's RateCard (and a last one for a version gone quiet)."""
        since = (now_ms() if now is None else now) - int(self.rate_window_s * 1000)
        served = await self.ledger.tokens_served_since(since)
        cards = [
            rate_card(served_id, served.get(served_id, 0), self.rate_window_s, self.hardware_cost_per_hour)
            for served_id in sorted({*served, *self._carded})
        ]
        for card in cards:
            await self.publish(card.key().encode(), encode(card))
        self._carded = set(served)
        return cards

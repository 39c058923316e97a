"""The gateway's guard: what a request passes between its body and Kafka, and what it gives back.

In order: authenticate (401), the model exists (404, in routes/), authorise the model (403),
validate against the model (400), the input guard (400 when the tenant blocks a likely prompt
injection; input_guard.py), admission control (503 breaker, 429 overload, queue too long or full lane),
rate limits per credential and per tenant (429 with Retry-After). An admitted request holds an
in-flight ticket and a token reservation; when its Exchange closes, the ticket is released and
the reservation is corrected by the usage of the terminal event, locally and for the peers.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

from schemas.messages import CancelReason, GenerateRequest, Priority, ReplyEnd, ReviewFlag, now_ms
from schemas.model_repo import ModelConfig
from services.gateway.config import GatewaySettings
from services.gateway.fleet import Fleet
from services.gateway.guard.admission import Admission, Ticket
from services.gateway.guard.auth import Authenticator, GuardError, Identity, KeyStore
from services.gateway.guard.input_guard import InputGuard
from services.gateway.guard.limits import Charge, RateLimited, RateLimiter, ScopeLimits
from services.gateway.guard.peers import PeerSync
from services.gateway.guard.validation import TokenCounter, check_request
from services.gateway.metrics import GatewayMetrics
from services.gateway.openai_format import ApiError, ChatCompletionBody, CompletionBody
from services.gateway.queue_wait import BatchBacklog

log = logging.getLogger(__name__)

PRIORITY_HEADER = "x-weir-priority"
_THREAD_COUNT_CHARS = 32_768  # prompts longer than this are tokenized off the event loop


class GuardBus(Protocol):
    """What the guard uses of the gateway's bus (kafka_bus.GatewayBus, a floor above the guard)."""

    gateway_id: str
    fleet: Fleet
    backlog: BatchBacklog
    on_cancel: list[Callable[[CancelReason], None]]

    def publish_review_flag(self, flag: ReviewFlag) -> None:
        """Publish an input guard's review flag (fire and forget)."""


class ClosingExchange(Protocol):
    """What Admitted.attach uses of an Exchange (kafka_bus.Exchange): its terminal and close hooks."""

    end: ReplyEnd | None
    on_close: list[Callable[[Any], None]]


@dataclass
class Admitted:
    """An admitted request: its identity, lane ticket and token reservation, until it ends."""

    guard: Guard
    identity: Identity
    ticket: Ticket
    charges: list[Charge]
    reserved_tokens: int
    is_released: bool = False

    def attach(self, exchange: ClosingExchange) -> None:
        """Release when the exchange closes (however it ends)."""
        exchange.on_close.append(lambda ex: self.release(ex.end))

    def release(self, end: ReplyEnd | None) -> None:
        """Give the ticket back and correct the reservation by the terminal's usage (exactly once).

        Without a terminal (the client left first) the reservation stands: the worker may have
        generated up to max_tokens before the cancel reached it.
        """
        if self.is_released:
            return
        self.is_released = True
        self.guard.on_released(self, end)


class Guard:
    """Authentication, validation, admission and rate limits of one gateway instance."""

    def __init__(
        self,
        settings: GatewaySettings,
        bus: GuardBus,
        desired: Callable[[str], str],
        clock: Callable[[], float] = time.monotonic,
        wanted_since: Callable[[str], int | None] = lambda _: None,
    ) -> None:
        """`desired`: what the registry wants of a version (catalog.Catalog.desired), and
        `wanted_since`: since when (Catalog.wanted_since), which admission asks of a version no
        live worker serves."""
        self.settings = settings
        self.bus = bus
        self.desired = desired
        self.wanted_since = wanted_since
        self.clock = clock
        self.keys = KeyStore()
        self.auth = Authenticator(settings, self.keys)
        self.limiter = RateLimiter(self.limits_of)
        self.admission = Admission(
            {"interactive": settings.max_in_flight_interactive, "bulk": settings.max_in_flight_bulk},
            settings.overload_waiting_ratio,
            settings.is_breaker_enabled,
        )
        self.counter = TokenCounter()
        self.peers = PeerSync(settings, bus.gateway_id, self.keys, self.limiter, clock)
        self.metrics = GatewayMetrics(lambda: bus.fleet.live(now_ms()), lambda: self.admission.open_breakers)
        self.metrics.follow_queue(bus.backlog)
        bus.on_cancel.append(lambda reason: self.metrics.cancellations.add(1, {"reason": reason}))
        self.input_guard = InputGuard(
            settings,
            bus.gateway_id,
            bus.publish_review_flag,
            on_detection=lambda d, action: self.metrics.input_guard.add(1, {"level": d.level, "action": action}),
        )

    async def start(self) -> None:
        """Start sharing keys and usage with the other instances (after the bus has started)."""
        await self.peers.start()

    async def stop(self) -> None:
        await self.peers.stop()

    def authenticate(self, headers: dict[str, str]) -> Identity:
        """The caller's Identity; 401 (counted) when credentials are missing or invalid."""
        try:
            return self.auth.authenticate(headers)
        except ApiError as error:
            self.metrics.auth_failures.add(1, {"code": error.code or "unknown"})
            raise

    def authorize(self, identity: Identity, model: str) -> None:
        """403 (counted) when `identity` may not use `model`."""
        try:
            self.auth.authorize(identity, model)
        except ApiError as error:
            self.metrics.auth_failures.add(1, {"code": error.code or "unknown"})
            raise

    async def admit(
        self,
        identity: Identity,
        body: ChatCompletionBody | CompletionBody,
        model: ModelConfig,
        request: GenerateRequest,
        headers: dict[str, str],
    ) -> tuple[GenerateRequest, Admitted]:
        """Validate, admit and charge a request; returns it with identity and lane set, and the
        Admitted to attach to its Exchange (or release if publishing fails)."""
        lane = priority_of(headers)
        prompt_tokens = await self._count_prompts(model, body)
        charge = check_request(
            body,
            request,
            model,
            prompt_tokens,
            max_input_tokens=self.settings.max_input_tokens,
            max_stop_sequences=self.settings.max_stop_sequences,
        )
        await self.input_guard.check(identity.principal, identity.tenant, body, self.counter.decoder(model))
        admitted = self.reserve(identity, model.served_id, lane, charge, deadline_ms=request.deadline_ms)
        request = request.model_copy(
            update={"principal": identity.principal, "tenant": identity.tenant, "priority": lane}
        )
        return request, admitted

    async def admit_embedding(
        self, identity: Identity, model: ModelConfig, inputs: list[str], headers: dict[str, str]
    ) -> tuple[Priority, Admitted]:
        """Admit and charge a /v1/embeddings body (its input tokens, estimated when the gateway has
        no tokenizer for the model); returns its lane and the Admitted to release when it ends."""
        lane = priority_of(headers)
        if sum(map(len, inputs)) > _THREAD_COUNT_CHARS:
            num_tokens = await asyncio.to_thread(self._count_inputs, model, inputs)
        else:
            num_tokens = self._count_inputs(model, inputs)
        return lane, self.reserve(identity, model.served_id, lane, num_tokens)

    def _count_inputs(self, model: ModelConfig, inputs: list[str]) -> int:
        return sum(self.counter.count(model, text) + 2 for text in inputs)  # + [CLS] and [SEP]

    def reserve(
        self, identity: Identity, model: str, lane: Priority, reserved_tokens: int, deadline_ms: int | None = None
    ) -> Admitted:
        """Take a lane ticket for version `model` (name@version) and charge the rate limits for
        reserved_tokens; ApiError 503/429. The breaker looks at what the live workers offer that
        version (fleet.Availability); one that cannot be served is 503 with the reason, and no
        Retry-After, since retrying cannot help. A request with a `deadline_ms` is refused when
        the queue's estimated wait (queue_wait.py, the last poll's) would not end before it."""
        try:
            now = now_ms()
            offer = self.bus.fleet.availability(model, self.desired(model), now, self.wanted_since(model))
            if offer.problem is not None:
                raise GuardError(503, offer.problem, param="model", code="model_unavailable")
            wait = self.bus.backlog.wait(model, offer.serving, now)
            to_deadline_s = None if deadline_ms is None else (deadline_ms - now) / 1000
            ticket = self.admission.admit(
                model, lane, offer.serving, coming=offer.coming, wait=wait, time_to_deadline_s=to_deadline_s
            )
        except ApiError as error:
            self.metrics.admission_rejected.add(1, {"model": model, "code": error.code or "unknown"})
            raise
        charges = self._charges(identity, reserved_tokens)
        try:
            self.limiter.admit(charges, self.clock())
        except RateLimited as limited:
            self.admission.release(ticket)
            self.metrics.rate_limited.add(1, {"scope": limited.scope.split(":")[0], "limit": limited.kind})
            raise rate_limit_error(limited) from None
        for charge in charges:
            self.peers.record(charge.scope, 1, charge.num_tokens)
        self.metrics.in_flight.add(1, {"model": model, "lane": lane})
        return Admitted(self, identity, ticket, charges, reserved_tokens)

    def on_released(self, admitted: Admitted, end: ReplyEnd | None) -> None:
        """Called once per admitted request when it ends or could not be published."""
        self.admission.release(admitted.ticket)
        self.metrics.in_flight.add(-1, {"model": admitted.ticket.model, "lane": admitted.ticket.lane})
        if end is None:
            return
        correction = end.usage.prompt_tokens + end.usage.completion_tokens - admitted.reserved_tokens
        if correction == 0:
            return
        now_s = self.clock()
        for charge in admitted.charges:
            if charge.limits.max_tokens_per_min is not None:
                self.limiter.debit(charge.scope, 0, correction, now_s, charge.limits)
                self.peers.record(charge.scope, 0, correction)

    def limits_of(self, scope: str) -> ScopeLimits | None:
        """The limits of a scope another instance reported (key records, tenant and JWT settings)."""
        kind, _, name = scope.partition(":")
        if kind == "key":
            record = self.keys.get(name)
            if record is None:
                return None
            return ScopeLimits(record.max_requests_per_min, record.max_tokens_per_min)
        if kind == "tenant":
            return self.tenant_limits(name)
        if kind == "sub":
            s = self.settings
            return ScopeLimits(s.jwt_max_requests_per_min, s.jwt_max_tokens_per_min)
        return None

    def tenant_limits(self, tenant: str) -> ScopeLimits:
        """The configured limits of `tenant` (its entry, else the "*" entry, else none)."""
        limits = self.settings.tenant_limits
        entry = limits.get(tenant) or limits.get("*")
        if entry is None:
            return ScopeLimits()
        return ScopeLimits(entry.max_requests_per_min, entry.max_tokens_per_min)

    def _charges(self, identity: Identity, reserved_tokens: int) -> list[Charge]:
        own = ScopeLimits(identity.max_requests_per_min, identity.max_tokens_per_min)
        return [
            Charge(identity.scope, own, reserved_tokens),
            Charge(f"tenant:{identity.tenant}", self.tenant_limits(identity.tenant), reserved_tokens),
        ]

    async def _count_prompts(self, model: ModelConfig, body: ChatCompletionBody | CompletionBody) -> list[int]:
        size = (
            sum(len(p) for p in body.prompts)
            if isinstance(body, CompletionBody)
            else sum(len(m.to_wire().content) for m in body.messages)
        )
        if size > _THREAD_COUNT_CHARS:
            return await asyncio.to_thread(self.counter.count_prompts, model, body)
        return self.counter.count_prompts(model, body)


def priority_of(headers: dict[str, str]) -> Priority:
    """The lane from X-Weir-Priority (interactive by default); 400 for anything else."""
    value = headers.get(PRIORITY_HEADER, "interactive").strip().lower()
    if value not in ("interactive", "bulk"):
        raise ApiError(
            400,
            f"X-Weir-Priority must be interactive or bulk, got {value!r}",
            param="X-Weir-Priority",
            code="invalid_value",
        )
    return cast(Priority, value)


def rate_limit_error(limited: RateLimited) -> GuardError:
    """429 in OpenAI's format with Retry-After in whole seconds (the openai client: RateLimitError)."""
    if limited.is_too_large:
        message = (
            f"Request too large for {limited.scope}: it needs more than the {limited.limit} "
            f"{limited.kind} per minute allowed; lower max_tokens or the prompt"
        )
        retry_after = 60
    else:
        retry_after = max(1, math.ceil(limited.retry_after_s))
        message = (
            f"Rate limit reached for {limited.scope}: {limited.limit} {limited.kind} per minute. "
            f"Please try again in {retry_after} s."
        )
    return GuardError(429, message, code="rate_limit_exceeded", headers={"retry-after": str(retry_after)})

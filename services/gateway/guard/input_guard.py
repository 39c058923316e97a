"""The input guard: prompts are screened for prompt injection before they reach Kafka.

Every completion prompt (a completion's prompt; a chat's messages, all roles but the assistant's)
goes through the InjectionDetector (injection.py: rules + a hashed-feature classifier, CPU,
about a millisecond), which reads the prompt through normalize.fold first (invisible characters
out, NFKC, combining marks out, Cyrillic/Greek look-alikes and small capitals folded to Latin).
What follows depends on the level and the tenant's action
(WEIR_INPUT_GUARD_ACTION, WEIR_INPUT_GUARD_TENANT_ACTIONS):

- high risk, action block: 400 prompt_injection_detected, nothing published;
- high risk, action flag: served, logged and counted;
- medium risk: served, counted (a signal, never blocked);
- every high-risk detection counts towards the review of the principal (within its tenant): the review_threshold-th
  within review_window_s publishes one ReviewFlag to the auditor (on the audit topic), with
  the rule names seen, never the prompt.

The count is per gateway instance: with N instances behind a balancer, a principal is flagged
after at most N x (threshold - 1) + 1 detections within the window.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from urllib.parse import quote

from schemas.messages import ReviewFlag
from services.gateway.guard.injection import Detection, InjectionDetector, RiskTracker
from services.gateway.guard.settings import GuardSettings, InputGuardAction
from services.gateway.openai_format import ApiError, ChatCompletionBody, CompletionBody

log = logging.getLogger(__name__)

_THREAD_CHARS = 16_384  # longer prompts are screened off the event loop
_MAX_RULE_SETS = 100_000  # principals whose rule names are remembered until their flag


class InputGuard:
    """Screens prompts, acts per tenant, and flags principals for review."""

    def __init__(
        self,
        settings: GuardSettings,
        gateway_id: str,
        publish_flag: Callable[[ReviewFlag], None],
        on_detection: Callable[[Detection, InputGuardAction], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.gateway_id = gateway_id
        self.publish_flag = publish_flag
        self.on_detection = on_detection  # metrics
        self.clock = clock
        self.is_enabled = settings.input_guard == "on"
        self.detector = InjectionDetector() if self.is_enabled else None
        self.tracker = RiskTracker(settings.review_threshold, settings.review_window_s)
        self._rules_seen: OrderedDict[str, set[str]] = OrderedDict()  # principal -> rule names since its last flag

    def action_of(self, tenant: str) -> InputGuardAction:
        """The tenant's action for high-risk prompts."""
        return self.settings.input_guard_tenant_actions.get(tenant, self.settings.input_guard_action)

    async def check(
        self,
        principal: str,
        tenant: str,
        body: ChatCompletionBody | CompletionBody,
        decode: Callable[[list[int]], str] | None = None,
    ) -> Detection | None:
        """Screen the body's prompt; returns the detection (None when the guard is off).

        Raises ApiError(400, code="prompt_injection_detected") for a high-risk prompt of a
        tenant whose action is block. Called by the guard before the request is published.
        """
        if self.detector is None:
            return None
        text = prompt_text(body, decode)
        detection = (
            await asyncio.to_thread(self.detector.detect, text)
            if len(text) > _THREAD_CHARS
            else (self.detector.detect(text))
        )
        if detection.level == "low":
            return detection
        action = self.action_of(tenant)
        if self.on_detection is not None:
            self.on_detection(detection, action)
        if detection.is_high_risk:
            log.warning(
                "input_guard principal=%s tenant=%s level=high score=%.3f rules=%s action=%s",
                principal,
                tenant,
                detection.score,
                ",".join(detection.rules) or "-",
                action,
            )
            self.record(principal, tenant, detection)
            if action == "block":
                raise ApiError(
                    400,
                    "the prompt was refused by the input guard as a likely prompt injection",
                    param="prompt" if isinstance(body, CompletionBody) else "messages",
                    code="prompt_injection_detected",
                )
        return detection

    def record(self, principal: str, tenant: str, detection: Detection) -> ReviewFlag | None:
        """Count one high-risk detection; publish and return the ReviewFlag when it is the one
        that reaches the threshold within the window."""
        now_s = self.clock()
        who = f"{quote(tenant, safe='')}:{principal}"  # counted per tenant: the same name elsewhere is someone else
        seen = self._rules_seen.pop(who, set())
        seen.update(detection.rules or ("classifier",))
        self._rules_seen[who] = seen
        if len(self._rules_seen) > _MAX_RULE_SETS:
            self._rules_seen.popitem(last=False)
        if not self.tracker.record(who, now_s):
            return None
        times = self.tracker.times(who, now_s)
        flag = ReviewFlag(
            flag_id=uuid.uuid4().hex,
            principal=principal,
            tenant=tenant,
            reason="prompt_injection",
            num_detections=len(times),
            window_s=max(1, round(self.settings.review_window_s)),
            first_detection_ms=int(times[0] * 1000),
            last_detection_ms=int(times[-1] * 1000),
            rules=sorted(self._rules_seen.pop(who, set()))[:64],
            gateway_id=self.gateway_id,
        )
        log.warning(
            "input_guard review_flag principal=%s tenant=%s detections=%d window_s=%d rules=%s",
            principal,
            tenant,
            flag.num_detections,
            flag.window_s,
            ",".join(flag.rules),
        )
        self.publish_flag(flag)
        return flag


def prompt_text(body: ChatCompletionBody | CompletionBody, decode: Callable[[list[int]], str] | None = None) -> str:
    """What the input guard screens: the prompts (token ids as `decode`, the model's tokenizer,
    reads them; ApiError 400 when there is none: a prompt the guard cannot read is not let past
    it), or every non-assistant message's content."""
    if isinstance(body, CompletionBody):
        if body.has_token_prompts and decode is None:
            raise ApiError(
                400,
                "prompts of token ids are screened by the input guard, which needs the model's "
                "tokenizer at the gateway; send the text",
                param="prompt",
                code="unsupported_parameter",
            )
        return "\n".join(p if isinstance(p, str) else decode(p) for p in body.prompts)  # type: ignore[misc]  # decode is set when has_token_prompts
    return "\n".join(m.to_wire().content for m in body.messages if m.role != "assistant")

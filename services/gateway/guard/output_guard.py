"""The output guard: personal data in a model's output never reaches the client.

Streams pass through a Redactor (redaction.py) per reader: text is released as soon as no
identity card, bank card, IBAN, phone number or e-mail address could still be forming at its
end, so a number split across token deltas (or across lines, or by a filler word) is caught,
and nothing is held longer than one hold-back window. A non-streaming body is redacted whole.
Both match on the normalised view of the text (normalize.py: invisible characters out, NFKC,
look-alike letters folded), so full-width digits, zero-width characters and Cyrillic letters
inside a value do not hide it, and replace the original characters. WEIR_OUTPUT_GUARD=off turns it off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from schemas.messages import TokenLogprob
from services.gateway.guard.redaction import Redactor, redact


class TextFilter(Protocol):
    """What a stream's text passes through on its way to a client."""

    @property
    def num_redacted(self) -> int:
        """Spans replaced so far."""
        ...

    @property
    def held(self) -> str:
        """Text received and not sent yet."""
        ...

    def feed(self, text: str) -> str:
        """The text that may be sent now (possibly empty)."""
        ...

    def flush(self) -> str:
        """The rest, at the end of the stream."""
        ...


class PassThrough:
    """No output guard: every delta goes out as it came."""

    num_redacted = 0
    held = ""

    def feed(self, text: str) -> str:
        return text

    def flush(self) -> str:
        return ""


class OutputGuard:
    """Makes the filter of each stream and redacts whole bodies; counts what it replaced."""

    def __init__(
        self, is_enabled: bool, max_holdback_chars: int, on_redacted: Callable[[int], None] | None = None
    ) -> None:
        self.is_enabled = is_enabled
        self.max_holdback_chars = max_holdback_chars
        self.on_redacted = on_redacted  # called with the number of spans replaced in one output
        if is_enabled:
            Redactor(max_holdback_chars)  # a window too small for the patterns fails at start, not per request

    def stream(self) -> Redactor | PassThrough:
        """A fresh filter for one reading of one stream."""
        return Redactor(self.max_holdback_chars) if self.is_enabled else PassThrough()

    def text(self, text: str) -> str:
        """A whole output, redacted."""
        if not self.is_enabled:
            return text
        redacted, num_redacted = redact(text)
        self.count(num_redacted)
        return redacted

    def count(self, num_redacted: int) -> None:
        """Report the spans replaced in one output (once per request, not per reader)."""
        if num_redacted and self.on_redacted is not None:
            self.on_redacted(num_redacted)


REDACTED_TOKEN = "[REDACTED]"


class LogprobGate:
    """The logprobs of one choice, released only with the text they stand for, and masked where
    the output guard redacted: token strings would otherwise show what the text no longer does.

    Tokens are placed on the output by their byte lengths, and a token is released once the
    guard has released the text up to its end (`filter.held` is what it holds back). When a
    feed redacted something, every token released with it, and the one after (it may straddle
    the end of the redacted span), shows `[REDACTED]` with no alternatives; its logprob, a
    number, stays. At the end of the choice every token left goes out, masked if the flush
    redacted. Where a reply's tokens are not all in its text (a stop string cut, tool call
    pieces), they are released by position, and all of them by the end.
    """

    def __init__(self, text_filter: TextFilter) -> None:
        self.filter = text_filter
        self._pending: list[TokenLogprob] = []
        self._fed_bytes = 0  # bytes of text fed to the filter
        self._released_bytes = 0  # bytes of tokens released so far
        self._taint_next = False

    def feed(self, text: str, logprobs: list[TokenLogprob] | None) -> tuple[str, list[TokenLogprob]]:
        """The text the filter releases now and the logprobs that go with it."""
        before = self.filter.num_redacted
        out = self.filter.feed(text)
        self._fed_bytes += len(text.encode())
        self._queue(logprobs)
        limit = self._fed_bytes - len(self.filter.held.encode())
        return out, self._release(limit, self.filter.num_redacted > before)

    def flush(self) -> tuple[str, list[TokenLogprob]]:
        """The rest of the text and every token left, at the end of the choice."""
        before = self.filter.num_redacted
        out = self.filter.flush()
        return out, self._release(None, self.filter.num_redacted > before)

    def _queue(self, logprobs: list[TokenLogprob] | None) -> None:
        self._pending.extend(logprobs or [])

    def _release(self, limit: int | None, redacted: bool) -> list[TokenLogprob]:
        released: list[TokenLogprob] = []
        while self._pending and (limit is None or self._released_bytes + len(self._pending[0].bytes) <= limit):
            token = self._pending.pop(0)
            self._released_bytes += len(token.bytes)
            released.append(token)
        if redacted or self._taint_next:
            masked = [_masked(t) for t in released]
            if self._taint_next and not redacted and masked:
                masked = [masked[0], *released[1:]]  # only the straddler of the earlier redaction
            released = masked
        self._taint_next = redacted and limit is not None
        return released


def _masked(token: TokenLogprob) -> TokenLogprob:
    return token.model_copy(
        update={"token": REDACTED_TOKEN, "bytes": list(REDACTED_TOKEN.encode()), "top_logprobs": []}
    )

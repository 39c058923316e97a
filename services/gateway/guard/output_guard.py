"""The output guard: personal data in a model's output never reaches the client.

Streams pass through a Redactor (redaction.py) per reader: text is released as soon as no
identity card, bank card, phone number or e-mail address could still be forming at its end, so
a number split across token deltas is caught, and nothing is held longer than one hold-back
window. A non-streaming body is redacted whole. Both match on the normalised view of the text
(normalize.py: invisible characters out, NFKC, look-alike letters folded), so full-width digits,
zero-width characters and Cyrillic letters inside a value do not hide it, and replace the
original characters. WEIR_OUTPUT_GUARD=off turns it off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from services.gateway.guard.redaction import Redactor, redact


class TextFilter(Protocol):
    """What a stream's text passes through on its way to a client."""

    @property
    def num_redacted(self) -> int:
        """Spans replaced so far."""
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

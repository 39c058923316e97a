"""The echo model: streams the prompt back, one piece per step, through the whole pipeline.

A deployment enables it (engine = "echo" in the model repository) to check streaming,
cancellation and output guards end to end without depending on what a trained model says.
"""

from __future__ import annotations

import re
import time

from schemas import context_length
from schemas.messages import EmbedRequest, ErrorInfo, GenerateRequest
from schemas.structured import constraint_of
from services.worker.engine.sequence import EngineOutput

_PIECES = re.compile(r"\s*\S+|\s+")
# GenerateRequest fields the echo model refuses, and why.
_UNSUPPORTED = {
    "logprobs": "logprobs (its tokens are words, drawn from no distribution)",
    "suffix": "suffix (it has no fill-in-the-middle; it echoes the prompt)",
    "prompt_logprobs": "prompt logprobs (it runs no model over the prompt)",
    "prompt_token_ids": "a prompt of token ids (it has no tokenizer; send the text)",
}


class _Echo:
    def __init__(self, request: GenerateRequest, text: str, now_ms: int) -> None:
        self.request = request
        self.text = text
        self.pieces = _PIECES.findall(text)
        self.pos = 0
        self.seq = 0
        self.received_ms = now_ms
        self.first_token_ms: int | None = None
        self.last_token_ms = 0


class EchoEngine:
    """Same contract as Engine (add, cancel, step, has_work, stats); 'tokens' are words."""

    weights_sha256 = "0" * 64

    def __init__(self, max_model_len: int = 2048, max_num_seqs: int = 256, step_delay_s: float = 0.0) -> None:
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.step_delay_s = step_delay_s  # pacing, so a test can cancel mid-stream
        self._active: dict[str, _Echo] = {}

    def add(self, request: GenerateRequest | EmbedRequest, now_ms: int) -> EngineOutput | None:
        """Queue a request; returns a terminal event at once if it is refused."""
        if not isinstance(request, GenerateRequest):
            info = ErrorInfo(code="unsupported_request_kind", message="the echo model generates text, not embeddings")
            return EngineOutput(
                request.request_id, 0, finish_reason="rejected", error=info, received_ms=now_ms, finished_ms=now_ms
            )
        if request.request_id in self._active:
            return None
        unsupported = [why for name, why in _UNSUPPORTED.items() if getattr(request, name) is not None]
        if constraint_of(request) is not None:  # echoing the prompt cannot follow a grammar: refuse, never relax
            unsupported.append("a constrained output (structured outputs, tool choice required or named)")
        if unsupported:  # refused, never faked (docs/design.md, invariant 6)
            info = ErrorInfo(
                code="unsupported_by_model", message="the echo model cannot serve " + "; ".join(unsupported)
            )
            return EngineOutput(
                request.request_id, 0, finish_reason="rejected", error=info, received_ms=now_ms, finished_ms=now_ms
            )
        text = request.prompt if request.prompt is not None else "\n".join(m.content for m in request.messages or [])
        echo = _Echo(request, text, now_ms)
        if len(echo.pieces) >= self.max_model_len:
            word: context_length.PromptWord = "prompt" if request.prompt is not None else "messages"
            message = context_length.prompt_too_long(self.max_model_len, len(echo.pieces), word)
            info = ErrorInfo(code="prompt_too_long", message=message)
            return EngineOutput(
                request.request_id, 0, finish_reason="rejected", error=info, received_ms=now_ms, finished_ms=now_ms
            )
        if request.deadline_ms <= now_ms:
            info = ErrorInfo(code="deadline_exceeded", message="deadline passed before the model ran")
            return EngineOutput(
                request.request_id, 0, finish_reason="timeout", error=info, received_ms=now_ms, finished_ms=now_ms
            )
        self._active[request.request_id] = echo
        return None

    def cancel(self, request_id: str, now_ms: int) -> EngineOutput | None:
        """Abort a request; returns its terminal event, or None if unknown."""
        echo = self._active.pop(request_id, None)
        if echo is None:
            return None
        return self._final(echo, "cancelled", now_ms, ErrorInfo(code="cancelled", message="request was cancelled"))

    @property
    def has_work(self) -> bool:
        return bool(self._active)

    def step(self, now_ms: int) -> list[EngineOutput]:
        """Emit the next piece of every active request."""
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        outputs: list[EngineOutput] = []
        for echo in list(self._active.values()):
            req = echo.request
            if req.deadline_ms <= now_ms:
                outputs.append(
                    self._end(echo, "timeout", now_ms, ErrorInfo(code="deadline_exceeded", message="deadline passed"))
                )
            elif echo.pos >= len(echo.pieces):
                outputs.append(self._end(echo, "stop", now_ms))
            elif echo.pos >= req.max_tokens:
                outputs.append(self._end(echo, "length", now_ms))
            else:
                piece = echo.pieces[echo.pos]
                echo.pos += 1
                gaps = None if echo.first_token_ms is None else [now_ms - echo.last_token_ms]  # inter-token latency
                echo.first_token_ms = echo.first_token_ms or now_ms
                echo.last_token_ms = now_ms
                outputs.append(
                    EngineOutput(req.request_id, echo.seq, text=piece, token_ids=[echo.pos - 1], itl_ms=gaps)
                )
                echo.seq += 1
        return outputs

    def _end(self, echo: _Echo, reason, now_ms: int, error: ErrorInfo | None = None) -> EngineOutput:
        del self._active[echo.request.request_id]
        return self._final(echo, reason, now_ms, error)

    def _final(self, echo: _Echo, reason, now_ms: int, error: ErrorInfo | None) -> EngineOutput:
        return EngineOutput(
            echo.request.request_id,
            echo.seq,
            finish_reason=reason,
            error=error,
            prompt_tokens=len(echo.pieces),
            completion_tokens=echo.pos,
            received_ms=echo.received_ms,
            first_token_ms=echo.first_token_ms,
            finished_ms=now_ms,
            prompt_text=echo.text,
            output_text="".join(echo.pieces[: echo.pos]),
        )

    def stats(self) -> dict[str, float]:
        return {
            "num_running": len(self._active),
            "num_waiting": 0,
            "free_kv_blocks": self.max_num_seqs - len(self._active),
            "num_kv_blocks": self.max_num_seqs,
            "prefix_hit_rate": 0.0,
        }

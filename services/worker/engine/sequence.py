"""A request's state inside the engine, and the events it produces."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from schemas.messages import ErrorInfo, FinishReason, GenerateRequest
from services.worker.engine.sampler import TokenBias, has_penalties


class Status(enum.Enum):
    WAITING = "waiting"  # not started, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks; prefilling or decoding
    FINISHED = "finished"


@dataclass
class EngineOutput:
    """One event of one request: a text delta, the end, or both.

    `seq` numbers events per request from 0, deterministically: a request regenerated after a
    crash produces the same numbers, so a reader drops the repeats.
    """

    request_id: str
    seq: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: ErrorInfo | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    received_ms: int | None = None
    first_token_ms: int | None = None
    finished_ms: int | None = None
    scheduled_ms: int | None = None  # final event: when the scheduler first ran it (None: no scheduler)
    cached_prompt_tokens: int = 0  # final event: prompt tokens found in the prefix cache at its admission
    itl_ms: list[int] | None = None  # gaps before each output token after the first (vLLM's inter-token latency)
    prompt_text: str | None = None  # on the final event only: for the audit HMACs
    output_text: str | None = None
    mean_token_entropy: float | None = None  # final event: mean entropy (nats) of the sampled steps
    watermark_z: float | None = None  # final event: the tenant's watermark z over the output, if any
    embeddings: list[list[float]] | None = None  # EmbedRequest's final event: one vector per input
    structured_valid: bool | None = None  # final event of a constrained request: the output is an instance of it

    @property
    def is_final(self) -> bool:
        """True for the request's terminal event."""
        return self.finish_reason is not None


class Sequence:
    """Tokens, KV blocks, sampling state and emitted text of one request."""

    def __init__(
        self, request: GenerateRequest, prompt_text: str, prompt_ids: list[int], max_tokens: int, now_ms: int
    ) -> None:
        self.request = request
        self.request_id = request.request_id
        self.rank = 0 if request.priority == "interactive" else 1  # scheduling lane: lower runs first
        self.prompt_text = prompt_text
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.max_tokens = max_tokens
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # content hashes of the full blocks computed so far
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.generator = torch.Generator().manual_seed(request.effective_seed)
        self.token_bias = TokenBias.of(request.logit_bias)  # built once, added at every step
        self.is_penalised = has_penalties(request)
        self.received_ms = now_ms
        self.first_token_ms: int | None = None
        self.last_token_ms = 0
        self.scheduled_ms: int | None = None  # set by the engine at its first step in a plan
        self.num_cached_prompt_tokens: int | None = None  # set by the scheduler at its first admission
        self._gaps_ms: list[int] | None = None  # inter-token gaps not yet carried by an event
        self.output_text = ""  # text accepted so far (stop strings excluded)
        self.num_emitted_chars = 0
        self.next_seq = 0
        self.num_emitted_ids = 0
        self.entropy_sum = 0.0  # sum over sampled steps of the model's token entropy (nats)
        self.num_sampled = 0
        self._hold_chars = max((len(s) for s in request.stop), default=1) - 1

    @property
    def output_ids(self) -> list[int]:
        """Generated token ids."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_pending(self) -> int:
        """Tokens whose K/V are not in the cache yet (1 when decoding)."""
        return len(self.token_ids) - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.status is Status.RUNNING and self.num_pending == 1 and self.num_output_tokens > 0

    def append_text(self, delta: str) -> FinishReason | None:
        """Add decoded text; returns "stop" when a stop string appeared (text cut before it)."""
        start = max(0, len(self.output_text) - self._hold_chars)
        self.output_text += delta
        for stop in self.request.stop:
            idx = self.output_text.find(stop, start)
            if idx != -1:
                self.output_text = self.output_text[:idx]
                return "stop"
        return None

    def take_delta(self, is_final: bool) -> str:
        """Text not yet emitted, holding back what could still become a stop string."""
        end = len(self.output_text) if is_final else max(self.num_emitted_chars, len(self.output_text) - self._hold_chars)
        delta = self.output_text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return delta

    def take_ids(self) -> list[int]:
        """Output token ids not yet carried by an event."""
        ids = self.output_ids[self.num_emitted_ids :]
        self.num_emitted_ids = self.num_output_tokens
        return ids

    def note_token(self, now_ms: int) -> None:
        """Time an output token taken in: the gap since the previous one is an inter-token latency
        (none for the first, whose time is first_token_ms). One int per token, no other allocation:
        this is the hot path."""
        if self.num_output_tokens > 1:
            if self._gaps_ms is None:
                self._gaps_ms = [now_ms - self.last_token_ms]
            else:
                self._gaps_ms.append(now_ms - self.last_token_ms)
        self.last_token_ms = now_ms

    def take_gaps(self) -> list[int] | None:
        """Inter-token gaps not yet carried by an event (None: none)."""
        gaps, self._gaps_ms = self._gaps_ms, None
        return gaps

    def event(self, text: str) -> EngineOutput:
        """A delta event with the next sequence number."""
        out = EngineOutput(self.request_id, self.next_seq, text=text, token_ids=self.take_ids(), itl_ms=self.take_gaps())
        self.next_seq += 1
        return out

    def final(self, reason: FinishReason, now_ms: int, error: ErrorInfo | None = None) -> EngineOutput:
        """The terminal event; carries any held-back text."""
        self.status = Status.FINISHED
        return EngineOutput(
            self.request_id,
            self.next_seq,
            text=self.take_delta(is_final=True) if error is None else "",
            token_ids=self.take_ids(),
            finish_reason=reason,
            error=error,
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=self.num_output_tokens,
            received_ms=self.received_ms,
            first_token_ms=self.first_token_ms,
            finished_ms=now_ms,
            scheduled_ms=self.scheduled_ms,
            cached_prompt_tokens=self.num_cached_prompt_tokens or 0,
            itl_ms=self.take_gaps(),
            prompt_text=self.prompt_text,
            output_text=self.output_text,
            mean_token_entropy=self.entropy_sum / self.num_sampled if self.num_sampled else None,
        )

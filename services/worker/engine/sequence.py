"""A request's state inside the engine, and the events it produces."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from schemas.messages import (
    ErrorInfo,
    FinishReason,
    GenerateRequest,
    PromptLogprob,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
)
from schemas.tools import tool_parser
from services.worker.engine.sampler import TokenBias, has_penalties


class Status(enum.Enum):
    WAITING = "waiting"  # not started, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks; prefilling or decoding
    FINISHED = "finished"


@dataclass
class EngineOutput:
    """One event of one request: a text delta, the end, or both.

    `seq` is the position of its first token: the index of that output token, so a request
    regenerated after a crash gives the same positions and a reader drops those it has. Its
    text and tool call pieces are the ones its last token's step released (an event is made
    when a step releases something; tokens whose steps released nothing go with it). The final
    event carries every token not carried yet, with what the end released (held text, an
    incomplete UTF-8 character as U+FFFD); with no token, what only the end released is the
    reply's tail position (schemas/messages.py: ReplyDelta).
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
    logprobs: list[TokenLogprob] | None = None  # the request asked: one per token of token_ids, in order
    prompt_logprobs: list[PromptLogprob | None] | None = None  # final event, when asked: one per prompt token
    # final event of a request that ran: sum of the raw logprobs of its output tokens (those of token_ids
    # and completion_tokens; an end-of-sequence token that ends it is not output, so not counted)
    cumulative_logprob: float | None = None
    tool_call_deltas: list[ToolCallDelta] | None = None  # pieces of tool calls made of this event's output
    tool_calls: list[ToolCall] | None = None  # final event: every tool call the reply made, complete
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
        self.num_emitted_ids = 0
        self.entropy_sum = 0.0  # sum over sampled steps of the model's token entropy (nats)
        self.num_sampled = 0
        self._hold_chars = max((len(s) for s in request.stop), default=1) - 1
        self.has_stop_string = False  # a stop string appeared: text after it, held or not, is no output
        self.cumulative_logprob = 0.0  # sum of the raw logprobs of the output tokens (ranks best_of)
        self._logprobs: list[TokenLogprob] | None = [] if request.logprobs is not None else None  # not yet carried
        # prompt_logprobs: one per prompt token by position, filled by the prefill (the engine
        # writes the first's, whose logprob is None: nothing predicts it)
        self.prompt_logprobs: list[PromptLogprob | None] | None = (
            [None] * len(prompt_ids) if request.prompt_logprobs is not None else None
        )
        # tool calls are parsed from the emitted text, so its events are a function of the tokens
        # (docs/design.md, "Structured output, tools and logprobs"); None: the request calls none
        self.tool_parser = tool_parser(request)

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
                self.has_stop_string = True
                return "stop"
        return None

    def take_delta(self, is_final: bool) -> str:
        """Text not yet emitted, holding back what could still become a stop string."""
        end = (
            len(self.output_text) if is_final else max(self.num_emitted_chars, len(self.output_text) - self._hold_chars)
        )
        delta = self.output_text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return delta

    def take_ids(self) -> list[int]:
        """Output token ids not yet carried by an event."""
        ids = self.output_ids[self.num_emitted_ids :]
        self.num_emitted_ids = self.num_output_tokens
        return ids

    @property
    def wants_logprobs(self) -> bool:
        """True when the request asked for per-token logprobs."""
        return self._logprobs is not None

    def note_logprob(self, logprob: float, entry: TokenLogprob | None) -> None:
        """Account the raw logprob of the output token just appended; `entry` is its wire form
        when the request asked for logprobs. Kept per token, so they follow token_ids, not text
        (held-back text around a stop string moves text between events, never tokens)."""
        self.cumulative_logprob += logprob
        if self._logprobs is not None:
            if entry is None:
                raise ValueError(f"{self.request_id} asked for logprobs: each output token needs its entry")
            self._logprobs.append(entry)

    def take_logprobs(self) -> list[TokenLogprob] | None:
        """Logprobs of the output tokens not yet carried by an event (None: not asked)."""
        if self._logprobs is None:
            return None
        entries, self._logprobs = self._logprobs, []
        return entries

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

    def event(self, text: str) -> EngineOutput | None:
        """A delta event at the position of its first token not yet carried; None when the tool
        call parser holds all of `text` back (its tokens then go with a later event)."""
        calls = None
        if self.tool_parser is not None:
            parsed = self.tool_parser.feed(text)
            text, calls = parsed.text, parsed.calls or None
            if not text and calls is None:
                return None
        return EngineOutput(
            self.request_id,
            self.num_emitted_ids,
            text=text,
            token_ids=self.take_ids(),
            itl_ms=self.take_gaps(),
            tool_call_deltas=calls,
            logprobs=self.take_logprobs(),
        )

    def final(self, reason: FinishReason, now_ms: int, error: ErrorInfo | None = None) -> EngineOutput:
        """The terminal event; carries any held-back text and, when the reply called tools, the calls."""
        self.status = Status.FINISHED
        text = self.take_delta(is_final=True) if error is None else ""
        deltas = calls = None
        if self.tool_parser is not None and error is None:
            parsed = self.tool_parser.finish(text)
            text, deltas, calls = parsed.text, parsed.calls or None, self.tool_parser.calls or None
        return EngineOutput(
            self.request_id,
            self.num_emitted_ids,  # before take_ids() below moves it
            text=text,
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
            logprobs=self.take_logprobs(),
            prompt_logprobs=self.prompt_logprobs if error is None else None,
            cumulative_logprob=self.cumulative_logprob,
            tool_call_deltas=deltas,
            tool_calls=calls,
        )

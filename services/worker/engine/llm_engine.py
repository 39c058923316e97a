"""The engine: continuous batching of a causal LM over a paged KV cache.

One step() is:

    outputs = self._expire(now_ms)           # end the sequences whose deadline passed
    plan = self.scheduler.schedule()         # who runs, on which blocks
    logits = self._run(plan)                 # one model forward over every scheduled token
    self.scheduler.commit(plan)              # the plan's tokens are in the KV cache now
    rows = sample_batch(logits, ...)         # per sampling row: token (penalties, logit_bias, grammar mask, watermark), raw logprobs
    outputs += self._postprocess(seq, ...)   # per sequence: detokenize, stop, emit

Synchronous and single-threaded: the worker's runner (services/worker/hosts/runner.py) calls step()
from its engine thread or child process, and tests and benchmarks call it directly.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from schemas import context_length
from schemas.messages import (
    EmbedRequest,
    ErrorInfo,
    GenerateRequest,
    PromptLogprob,
    StructuredOutputs,
    TokenLogprob,
    TopLogprob,
)
from schemas.structured import UnsupportedSchema, check_structured, constraint_of
from schemas.tools import tools_problem
from services.worker.engine.grammar import CLOSE_BIAS, GrammarError, Grammars, JsonCloser, StepMask, is_instance
from services.worker.engine.kv_cache import BlockManager, allocate_kv_caches, bytes_per_block
from services.worker.engine.model import AttentionMetadata, CausalLM, load_model, weights_sha256
from services.worker.engine.sampler import sample_batch
from services.worker.engine.scheduler import Scheduler, StepPlan
from services.worker.engine.sequence import EngineOutput, Sequence, Status
from services.worker.engine.tokenizer import IncrementalDetokenizer, ModelTokenizer, SuffixUnsupported, TokenizerError
from services.worker.engine.watermark import Watermarker
from weir.chat_template import ChatTemplateError

if TYPE_CHECKING:
    import xgrammar as xgr  # imported by grammar.py where used: it pulls in transformers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """How one engine instance is sized."""

    max_model_len: int = 512
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 8
    kv_cache_bytes: int = 256 * 1024 * 1024  # CPU budget; on CUDA a share of free memory is used
    gpu_memory_fraction: float = 0.85
    enable_prefix_caching: bool = True
    is_prioritized: bool = True  # interactive before bulk (the model's lane_policy is not "fifo")
    quantization: str = "none"  # CPU: "int8" / "int4" projections (model.QuantLinear), "none": float32

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"{self.max_num_batched_tokens=} must be >= 1")


class Engine:
    """Serves one model: add requests, step, read outputs."""

    def __init__(
        self,
        model_path: str | Path,
        config: EngineConfig,
        device: torch.device | None = None,
        watermarker: Watermarker | None = None,
    ) -> None:
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.config = config
        self.watermarker = watermarker or Watermarker({})
        # When tokens are taken: the serving worker's wall clock, read after the forward pass, so
        # first-token, inter-token and prefill times include the pass that made them; None (tests,
        # benches that drive the engine with their own times): the `now_ms` step() was given.
        self.clock: Callable[[], int] | None = None
        quantization = config.quantization if self.device.type == "cpu" else "none"
        if quantization != config.quantization:  # the setting is the CPU's (schemas/model_repo.py): said, not hidden
            log.warning(
                "engine: quantization %s applies on the CPU; on %s the weights load in %s",
                config.quantization,
                self.device,
                self.dtype,
            )
        self.model: CausalLM = load_model(model_path, self.device, self.dtype, quantization)
        self.tokenizer = ModelTokenizer(model_path)
        self.weights_sha256 = weights_sha256(Path(model_path))
        args = self.model.args
        self.rotary = self.model.rotary
        # ids that end generation: config/generation_config eos, the tokenizer's eos and the chat
        # template's end-of-turn token (<|im_end|>, <|eot_id|>) when it is a special token
        self.eos_ids = set(args.eos_token_ids) | self.tokenizer.stop_token_ids
        self.max_model_len = min(config.max_model_len, args.max_context_len)
        per_block = bytes_per_block(args.num_layers, config.block_size, args.num_kv_heads, args.head_dim, self.dtype)
        num_blocks = self._kv_budget_bytes() // per_block
        if num_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"KV cache of {num_blocks} blocks x {config.block_size} tokens cannot hold one sequence of "
                f"max_model_len={self.max_model_len}; raise kv_cache_bytes or lower max_model_len"
            )
        self.kv_caches = allocate_kv_caches(
            args.num_layers, num_blocks, config.block_size, args.num_kv_heads, args.head_dim, self.dtype, self.device
        )
        self.kv_bytes_per_token = per_block // config.block_size
        # dynamic NTK rotates a prompt's keys for the prompt's length: no sharing between prompts
        is_prefix_caching = config.enable_prefix_caching and not args.rope.is_length_dependent
        self.blocks = BlockManager(num_blocks, config.block_size, is_prefix_caching)
        self.scheduler = Scheduler(
            self.blocks, config.max_num_seqs, config.max_num_batched_tokens, is_prioritized=config.is_prioritized
        )
        self._seqs: dict[str, Sequence] = {}
        # the step's prompt_logprobs rows: (sequence, the prompt positions whose next token they predict)
        self._prompt_rows: list[tuple[Sequence, range]] = []
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self.model_path = Path(model_path)
        self._grammars: Grammars | None = None  # built at the first constraint (its tokenizer info takes seconds)
        self._step_mask: StepMask | None = None
        # built off the step thread at the first constraint (seconds on a 49k vocabulary); a constrained
        # sequence starts only once it is ready, so every step of it is steered alike (invariant 3)
        self._closer: Future[JsonCloser] | None = None
        self._json_ids: set[str] = set()  # constrained to JSON (schema, json_object, tool call): closed near max_tokens
        self._matchers: dict[str, xgr.GrammarMatcher] = {}  # request_id -> its matcher, for constrained sequences
        self._compiling: dict[str, tuple[Sequence, Future]] = {}  # waiting for their grammar: seq, future
        log.info(
            "engine: %s on %s %s, weights %s %.0f MB, %d KV blocks of %d tokens",
            model_path,
            self.device,
            self.dtype,
            self.model.quantization,
            self.model.weight_bytes / 1e6,
            num_blocks,
            config.block_size,
        )

    def _kv_budget_bytes(self) -> int:
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            return int(free * self.config.gpu_memory_fraction)
        return self.config.kv_cache_bytes

    # -- requests in -------------------------------------------------------------------------

    def add(self, request: GenerateRequest | EmbedRequest, now_ms: int) -> EngineOutput | None:
        """Queue a request. Returns its terminal event at once if it is refused, else None."""
        if not isinstance(request, GenerateRequest):
            message = "this model generates text; embeddings need an embedding model"
            return _refused(request, now_ms, "rejected", "unsupported_request_kind", message)
        if request.request_id in self._seqs or request.request_id in self._compiling:
            return None  # already running: a redelivery, the first copy answers
        if request.prompt_token_ids is not None:  # a prompt of token ids: run as given (as vLLM's)
            vocab = self.model.args.vocab_size
            if any(not 0 <= i < vocab for i in request.prompt_token_ids):
                message = f"prompt token ids must be 0 to {vocab - 1}, the vocabulary of {request.model}"
                return _refused(request, now_ms, "rejected", "invalid_prompt", message)
            return self.add_tokens(request, request.prompt_token_ids, now_ms)
        try:
            prompt_text = self.tokenizer.render(request)
            prompt_ids = self.tokenizer.encode(prompt_text)
        except SuffixUnsupported as exc:  # refused, never ignored (docs/design.md, invariant 6)
            return _refused(
                request, now_ms, "rejected", "suffix_unsupported", f"{request.model} cannot take a suffix: {exc}"
            )
        except ChatTemplateError as exc:  # the template refused this chat (e.g. a role order): the client's to fix
            return _refused(request, now_ms, "rejected", "chat_template_error", str(exc))
        except TokenizerError as exc:
            return _refused(request, now_ms, "error", "tokenizer_error", str(exc))
        return self.add_tokens(request, prompt_ids, now_ms, prompt_text)

    def add_tokens(
        self, request: GenerateRequest, prompt_ids: list[int], now_ms: int, prompt_text: str | None = None
    ) -> EngineOutput | None:
        """Queue a request whose prompt is already tokenized (benchmarks, tests)."""
        if not prompt_ids:
            return _refused(request, now_ms, "rejected", "empty_prompt", "the prompt encodes to no tokens")
        if len(prompt_ids) >= self.max_model_len:  # in OpenAI's words, which clients match (schemas/context_length.py)
            word: context_length.PromptWord = "prompt" if request.prompt is not None else "messages"
            message = context_length.prompt_too_long(self.max_model_len, len(prompt_ids), word)
            return _refused(request, now_ms, "rejected", "prompt_too_long", message)
        if request.deadline_ms <= now_ms:
            return _refused(request, now_ms, "timeout", "deadline_exceeded", "deadline passed before the model ran")
        outside = [k for k in request.logit_bias or {} if int(k) >= self.model.args.vocab_size]
        if outside:
            return _refused(
                request,
                now_ms,
                "rejected",
                "invalid_logit_bias",
                f"logit_bias names token id {outside[0]}, outside the vocabulary of {request.model} "
                f"(token ids 0 to {self.model.args.vocab_size - 1})",
            )
        if (problem := tools_problem(request.tools)) is not None:  # a raw Kafka request the gateway would refuse
            message = f"tools[{problem[0]}]: {problem[1]}"
            return _refused(request, now_ms, "rejected", "invalid_tool_parameters", message)
        strict = [i for i, t in enumerate(request.tools or []) if t.function.strict]
        if strict and request.tool_choice in (None, "auto"):  # as the gateway: a promise auto cannot keep
            message = (
                f"tools[{strict[0]}]: strict needs tool_choice required or a named function; "
                "calls under auto are parsed from the model's text, not constrained"
            )
            return _refused(request, now_ms, "rejected", "unsupported_parameter", message)
        spec = constraint_of(request)
        if spec is not None and (refused := self._refuse_constraint(request, spec, now_ms)) is not None:
            return refused
        max_tokens = min(request.max_tokens, self.max_model_len - len(prompt_ids))
        text = prompt_text if prompt_text is not None else self.tokenizer.decode(prompt_ids)
        seq = Sequence(request, text, prompt_ids, max_tokens, now_ms)
        if spec is None:
            self._start(seq, None)
            return None
        # compiled off the step thread (grammar.py); a cached grammar is admitted at once
        self.prewarm_constraints()
        self._compiling[request.request_id] = (seq, self.grammars.submit(spec))
        outputs = self._admit_compiled(now_ms, only=request.request_id)
        return outputs[0] if outputs else None

    def _start(self, seq: Sequence, matcher: xgr.GrammarMatcher | None) -> None:
        self._seqs[seq.request_id] = seq
        self._detok[seq.request_id] = IncrementalDetokenizer(self.tokenizer)
        if matcher is not None:
            self._matchers[seq.request_id] = matcher
            spec = constraint_of(seq.request)
            if spec is not None and (spec.json_schema is not None or spec.json_object):
                self._json_ids.add(seq.request_id)
        self.scheduler.add(seq)

    def prewarm_constraints(self) -> None:
        """Start what the first constraint needs, off the step thread: the grammar compile child and
        the JSON closer's tables (the worker calls it once the model is loaded: WEIR_GRAMMAR_PREWARM)."""
        if self._closer is None:
            self._closer = Future()
            self.grammars.prewarm()
            threading.Thread(target=self._build_closer, args=(self._closer,), name="json-closer", daemon=True).start()

    def _build_closer(self, future: Future[JsonCloser]) -> None:
        try:
            future.set_result(JsonCloser(self.tokenizer.vocabulary_bytes(), self.model.args.vocab_size))
        except BaseException as exc:  # noqa: BLE001 - reported to each sequence that waits for it
            future.set_exception(exc)

    @property
    def grammars(self) -> Grammars:
        """This model's grammar cache, with the engine's eos ids as the grammar's stop tokens."""
        if self._grammars is None:
            self._grammars = Grammars(self.model_path, self.model.args.vocab_size, self.eos_ids)
        return self._grammars

    def _refuse_constraint(self, request: GenerateRequest, spec: StructuredOutputs, now_ms: int) -> EngineOutput | None:
        """Refuse a constraint Weir cannot enforce (docs/design.md invariant 6: refuse, never relax)."""
        try:
            check_structured(spec)
        except UnsupportedSchema as exc:
            return _refused(request, now_ms, "rejected", "unsupported_schema", str(exc))
        if request.ignore_eos:
            message = "ignore_eos cannot be combined with a structured-output constraint: the output ends where the grammar does"
            return _refused(request, now_ms, "rejected", "unsupported_parameter", message)
        return None

    def _admit_compiled(self, now_ms: int, only: str | None = None) -> list[EngineOutput]:
        """Start the sequences whose grammar compiled (only `only`, when given); the refusals of
        those whose grammar failed or took too long (grammar.py bounds each compile and resolves
        its future; the step only polls)."""
        outputs: list[EngineOutput] = []
        for request_id, (seq, future) in list(self._compiling.items()):
            if only is not None and request_id != only:
                continue
            if not future.done() or not (self._closer is not None and self._closer.done()):
                continue
            del self._compiling[request_id]
            refused = self._admit(seq, future, now_ms)
            if refused is not None:
                outputs.append(refused)
        return outputs

    def _admit(self, seq: Sequence, future: Future, now_ms: int) -> EngineOutput | None:
        """Start `seq` with a matcher of its compiled grammar, or its refusal."""
        try:
            compiled = future.result()
            assert self._closer is not None
            self._closer.result()  # built with the first constraint
        except GrammarError as exc:
            return _refused(seq.request, now_ms, "rejected", exc.code, str(exc))
        except Exception as exc:  # e.g. a tokenizer.json xgrammar cannot read: this request fails, the engine goes on
            log.exception("grammar compile failed")
            return _refused(seq.request, now_ms, "error", "grammar_error", f"{type(exc).__name__}: {exc}")
        self._start(seq, self.grammars.matcher(compiled))
        return None

    def cancel(self, request_id: str, now_ms: int) -> EngineOutput | None:
        """Abort a request and free its KV blocks. Returns its terminal event, or None if unknown."""
        compiling = self._compiling.pop(request_id, None)
        if compiling is not None:
            return _refused(compiling[0].request, now_ms, "cancelled", "cancelled", "request was cancelled")
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        return self._finish(seq, "cancelled", now_ms, ErrorInfo(code="cancelled", message="request was cancelled"))

    # -- the loop ----------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._compiling)

    def step(self, now_ms: int) -> list[EngineOutput]:
        """Run one iteration: expire, schedule, forward, sample. Returns the events it made."""
        outputs = self._expire(now_ms)
        if self._compiling:
            outputs += self._admit_compiled(now_ms)
        plan = self.scheduler.schedule()
        if plan.is_empty:
            if self._compiling and not outputs:  # nothing to run but grammars compiling: wait, do not spin
                pending = [f for _, f in self._compiling.values() if not f.done()]
                if self._closer is not None and not self._closer.done():
                    pending.append(self._closer)
                wait(pending, timeout=0.01, return_when=FIRST_COMPLETED)
            return outputs
        for chunk in plan.prefills:  # vLLM's queue time ends at the first step a request is in
            if chunk.seq.scheduled_ms is None:
                chunk.seq.scheduled_ms = now_ms
        if self.device.type == "cpu":
            # the CPU attention pads each decode to the widest block table of its group: order
            # decodes widest first so that split_by_width can group similar widths
            plan.decodes.sort(key=lambda c: len(c.seq.block_table), reverse=True)
        logits = self._run(plan)
        self.scheduler.commit(plan)
        seqs = [c.seq for c in plan.prefills if c.samples] + [c.seq for c in plan.decodes]
        if self._prompt_rows:
            self._note_prompt_logprobs(logits[len(seqs) :])
            logits = logits[: len(seqs)]
        vocab_size = logits.shape[-1]
        biases = [self.watermarker.bias(s.request.tenant, s.token_ids[-1], vocab_size) for s in seqs]
        histories = [s.output_ids if s.is_penalised else [] for s in seqs]  # only penalties read them
        rows = sample_batch(
            logits,
            [s.request for s in seqs],
            [s.generator for s in seqs],
            biases,
            histories,
            [s.token_bias for s in seqs],
            [s.request.logprobs for s in seqs],
            mask=self._grammar_mask(seqs),
        )
        taken_ms = self.clock() if self.clock is not None else now_ms
        for seq, token, entropy, logprob, top in zip(seqs, *rows, strict=True):
            outputs.extend(self._postprocess(seq, token, entropy, logprob, top, taken_ms))
        return outputs

    def _note_prompt_logprobs(self, rows: torch.Tensor) -> None:
        """Keep the logprob (and the asked alternatives) of each prompt token the step's prompt
        rows predict, by position: a sequence recomputed after a preemption writes the same again."""
        logprobs = torch.log_softmax(rows.float(), dim=-1)
        at = 0
        for seq, positions in self._prompt_rows:
            k = seq.request.prompt_logprobs or 0
            block = logprobs[at : at + len(positions)]
            at += len(positions)
            if positions.start == 0:  # nothing predicts the first prompt token: its text only
                first = seq.token_ids[0]
                text, raw = self.tokenizer.token_piece(first)
                seq.prompt_logprobs[0] = PromptLogprob(token_id=first, token=text, bytes=raw, logprob=None)  # type: ignore[index]  # a list: this row was asked for
            if not len(positions):
                continue
            targets = torch.tensor([seq.token_ids[p + 1] for p in positions], dtype=torch.long)
            chosen = block.gather(1, targets[:, None])[:, 0].tolist()
            top = torch.topk(block, k, dim=-1) if k else None
            for i, p in enumerate(positions):
                alternatives = list(zip(top.indices[i].tolist(), top.values[i].tolist(), strict=True)) if top else None
                token = seq.token_ids[p + 1]
                entry = self._token_logprob(token, chosen[i], alternatives)
                seq.prompt_logprobs[p + 1] = PromptLogprob.model_construct(**dict(entry))  # type: ignore[index]  # a list: this row was asked for

    def _grammar_mask(self, seqs: list[Sequence]) -> Callable[[torch.Tensor], None] | None:
        """The step's grammar mask over `seqs`' rows, or None when no row is constrained."""
        if not self._matchers:
            return None
        matchers = [self._matchers.get(s.request_id) for s in seqs]
        if not any(m is not None for m in matchers):
            return None
        if self._step_mask is None:
            self._step_mask = StepMask(self.model.args.vocab_size, self.config.max_num_seqs)
        assert self._closer is not None and self._closer.done()  # constrained sequences start once it is built
        step_mask, closer = self._step_mask, self._closer.result()
        weights = [self._close_weight(s) for s in seqs]
        closing = [(r, s.output_ids, w) for r, (s, w) in enumerate(zip(seqs, weights, strict=True)) if w > 0]

        def mask(logits: torch.Tensor) -> None:
            step_mask.apply(logits, matchers)
            closer.steer(logits, closing)

        return mask

    def _close_weight(self, seq: Sequence) -> float:
        """How hard a JSON-constrained row is steered to close (0: not): as it nears max_tokens
        (JsonCloser.weight), and fully once its tool calls repeat a call it made (schemas/tools.py:
        a small model under tool_choice required repeats its call until max_tokens; the array
        closes instead, with the calls made once). Both are functions of the row's own tokens."""
        if seq.request_id not in self._json_ids:
            return 0.0
        if seq.tool_parser is not None and seq.tool_parser.is_repeating:
            return CLOSE_BIAS
        return JsonCloser.weight(seq.num_output_tokens, seq.max_tokens)

    def _expire(self, now_ms: int) -> list[EngineOutput]:
        expired = [s for s in self._seqs.values() if s.request.deadline_ms <= now_ms]
        info = ErrorInfo(code="deadline_exceeded", message="the request's deadline passed")
        outputs = [self._finish(s, "timeout", now_ms, info) for s in expired]
        for request_id in [r for r, (s, _) in self._compiling.items() if s.request.deadline_ms <= now_ms]:
            seq, _ = self._compiling.pop(request_id)
            outputs.append(
                _refused(seq.request, now_ms, "timeout", "deadline_exceeded", "the request's deadline passed")
            )
        return outputs

    def _run(self, plan: StepPlan) -> torch.Tensor:
        bs = self.blocks.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        meta = AttentionMetadata(slot_mapping=torch.empty(0))
        logit_rows: list[int] = []
        for chunk in plan.prefills:
            seq, t0 = chunk.seq, len(ids)
            ids.extend(seq.token_ids[chunk.start : chunk.end])
            positions.extend(range(chunk.start, chunk.end))
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in range(chunk.start, chunk.end))
            table = torch.tensor(seq.block_table, dtype=torch.long, device=self.device)
            meta.prefills.append((t0, len(ids), table, chunk.end))
            if chunk.samples:
                logit_rows.append(len(ids) - 1)
        if plan.decodes:
            for chunk in plan.decodes:
                seq, p = chunk.seq, chunk.start
                logit_rows.append(len(ids))
                ids.append(seq.token_ids[p])
                positions.append(p)
                slots.append(seq.block_table[p // bs] * bs + p % bs)
            meta.num_decode_tokens = len(plan.decodes)
            widths = [len(c.seq.block_table) for c in plan.decodes]
            groups = split_by_width(widths, DECODE_GROUP_MIN_SAVING_BLOCKS) if self.device.type == "cpu" else None
            for start, end in groups or [(0, len(widths))]:
                width = max(widths[start:end])
                tables = [c.seq.block_table + [0] * (width - len(c.seq.block_table)) for c in plan.decodes[start:end]]
                lens = [c.end for c in plan.decodes[start:end]]
                meta.decode_groups.append(
                    (
                        start,
                        end,
                        torch.tensor(tables, dtype=torch.int32, device=self.device),
                        torch.tensor(lens, dtype=torch.int32, device=self.device),
                    )
                )
        # after the sampling rows: the rows of the prompt positions whose logits a request asked
        # for (prompt_logprobs; only those requests pay for them), each predicting the next prompt token
        self._prompt_rows = []
        for chunk, (t0, *_rest) in zip(plan.prefills, meta.prefills, strict=True):
            seq = chunk.seq
            if seq.prompt_logprobs is not None:
                positions_asked = range(chunk.start, min(chunk.end, seq.num_prompt_tokens - 1))
                self._prompt_rows.append((seq, positions_asked))
                logit_rows.extend(t0 + p - chunk.start for p in positions_asked)
        meta.rope_seq_lens = self._rope_seq_lens(plan)
        meta.slot_mapping = torch.tensor(slots, dtype=torch.long, device=self.device)
        meta.logits_indices = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return self.model(input_ids, pos, self.kv_caches, meta).cpu()

    def _rope_seq_lens(self, plan: StepPlan) -> torch.Tensor | None:
        """Per token, the sequence length its rotation is for, when the model's RoPE needs it:
        a prompt token the prompt's length, a generated token its position + 1 (engine/rope.py)."""
        if not self.rotary.rope.is_length_dependent:
            return None
        chunks = [*plan.prefills, *plan.decodes]  # the token order of _run
        lens = [max(c.seq.num_prompt_tokens, p + 1) for c in chunks for p in range(c.start, c.end)]
        if not self.rotary.needs_seq_lens(max(lens, default=0)):
            return None
        return torch.tensor(lens, dtype=torch.long, device=self.device)

    def _postprocess(
        self,
        seq: Sequence,
        token: int | None,
        entropy: float,
        logprob: float | None,
        top: list[tuple[int, float]] | None,
        now_ms: int,
    ) -> list[EngineOutput]:
        """Take one sampled token (None: the row's logits were not finite), its raw logprob and
        the alternatives its request asked for into `seq`."""
        if seq.status is not Status.RUNNING:
            return []
        if seq.max_tokens == 0:  # only the prompt's logprobs were asked: the prefill is the answer
            return [self._finish(seq, "length", now_ms)]
        if token is None or logprob is None:  # both None together: the row's logits were not finite
            info = ErrorInfo(code="non_finite_logits", message="the model produced non-finite logits")
            return [self._finish(seq, "error", now_ms, info)]
        seq.entropy_sum += entropy
        seq.num_sampled += 1
        if seq.first_token_ms is None:
            seq.first_token_ms = now_ms
        matcher = self._matchers.get(seq.request_id)
        if matcher is not None:
            if not matcher.accept_token(token):  # the mask allowed it: a grammar engine bug, never served
                info = ErrorInfo(code="grammar_violation", message=f"token {token} broke the constraint")
                return [self._finish(seq, "error", now_ms, info)]
            if matcher.is_terminated():  # it took an end-of-sequence token where the grammar may end
                return [self._finish(seq, "stop", now_ms)]
        if token in self.eos_ids and not seq.request.ignore_eos:
            return [self._finish(seq, "stop", now_ms)]
        seq.token_ids.append(token)
        seq.note_token(now_ms)
        seq.note_logprob(logprob, self._token_logprob(token, logprob, top) if seq.wants_logprobs else None)
        reason = seq.append_text(self._detok[seq.request_id].step(seq.output_ids))
        if reason is None and seq.num_output_tokens >= seq.max_tokens:
            reason = "length"
        if reason is not None:
            return [self._finish(seq, reason, now_ms)]
        delta = seq.take_delta(is_final=False)
        out = seq.event(delta) if delta else None
        return [out] if out is not None else []

    def _token_logprob(self, token: int, logprob: float, top: list[tuple[int, float]] | None) -> TokenLogprob:
        """The wire form of an output token's logprob, with its request's alternatives."""
        text, raw = self.tokenizer.token_piece(token)
        alternatives = [
            TopLogprob(token_id=i, token=t, bytes=b, logprob=lp)
            for i, lp in top or []
            for t, b in [self.tokenizer.token_piece(i)]
        ]
        return TokenLogprob(token_id=token, token=text, bytes=raw, logprob=logprob, top_logprobs=alternatives)

    def _finish(self, seq: Sequence, reason, now_ms: int, error: ErrorInfo | None = None) -> EngineOutput:
        self.scheduler.remove(seq)
        self._seqs.pop(seq.request_id, None)
        detok = self._detok.pop(seq.request_id, None)
        if detok is not None and error is None and not seq.has_stop_string:
            # what the detokenizer still holds (an incomplete UTF-8 character: U+FFFD) is output text:
            # its tokens were generated and counted, so their text comes out with them
            seq.append_text(detok.flush(seq.output_ids))
        self._matchers.pop(seq.request_id, None)
        self._json_ids.discard(seq.request_id)
        out = seq.final(reason, now_ms, error)
        out.watermark_z = self.watermarker.z_score(seq.request.tenant, seq.output_ids)
        spec = constraint_of(seq.request)
        if spec is not None:  # the output SLA: a truncated ("length") or failed output is not valid
            out.structured_valid = reason == "stop" and is_instance(spec, out.output_text or "")
        return out

    # -- introspection -----------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Gauges and running totals for heartbeats and /metrics (services/worker/kafka/serving_metrics.py)."""
        blocks = self.blocks
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "free_kv_blocks": blocks.num_free,
            "num_kv_blocks": blocks.num_blocks,
            "kv_cache_usage_perc": 1.0 - blocks.num_free / blocks.num_blocks,
            "prefix_hit_rate": blocks.prefix_hit_rate,
            "prefix_cache_queries": blocks.prefix_cache_queries,
            "prefix_cache_hits": blocks.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
        }


# Padding (in KV blocks over the step's decodes) a separate attention call must save to be worth
# its fixed cost on the CPU (~0.1 ms a layer, the time to gather and attend ~80 blocks).
DECODE_GROUP_MIN_SAVING_BLOCKS = 64


def split_by_width(widths: list[int], min_saving: int) -> list[tuple[int, int]]:
    """Runs [start, end) of `widths` (block-table lengths, sorted descending) to attend separately.

    Each run is padded to its first width. A new run starts where widths fell to 60% of the
    run's and padding the rest to the run's width would cost at least `min_saving` blocks.
    """
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(widths)):
        if widths[i] <= 0.6 * widths[start] and (widths[start] - widths[i]) * (len(widths) - i) >= min_saving:
            runs.append((start, i))
            start = i
    runs.append((start, len(widths)))
    return runs


def _refused(request: GenerateRequest | EmbedRequest, now_ms: int, reason, code: str, message: str) -> EngineOutput:
    return EngineOutput(
        request.request_id,
        0,
        finish_reason=reason,
        error=ErrorInfo(code=code, message=message),
        received_ms=now_ms,
        finished_ms=now_ms,
    )

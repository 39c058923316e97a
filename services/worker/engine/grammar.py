"""Structured-output constraints as token masks inside the batched step (xgrammar).

docs/design.md, "Structured output, tools and logprobs": a constraint is compiled once per
canonical spec and model, from the model's own tokenizer.json (nothing is downloaded), cached with
a bound; each constrained row's mask is filled from its matcher and applied after logit_bias and
penalties, before temperature, watermark, top-k and top-p; the end-of-sequence tokens are allowed
only where the grammar may end. A matcher's state is a function of the output tokens alone, so a
regenerated or preempted request rebuilds the same masks (invariant 3).

    Grammars(model_path, vocab_size, stop_ids)   per engine: compile (off the step thread) and cache
    StepMask(grammars)                          one reusable bitmask; fill constrained rows, apply
    is_instance(spec, text)                     the output SLA check (ReplyEnd.structured_valid)
    JsonCloser(pieces, width)                   near max_tokens, steer a JSON row toward closing

A small model can ramble inside a string nothing bounds (or write a 35-digit number) until
max_tokens cuts its JSON short. Within max(CLOSE_MIN_TOKENS, CLOSE_SHARE x max_tokens) tokens of
its budget, a JSON-constrained row's logits get, after the mask, a bias per nesting level
(bracket, open string, open number) each token closes, and against each it opens, growing to where
the row takes the allowed token that closes most, the model choosing among equals; so the output
is still an instance of the schema and ends `stop`.

Compilation runs in a child process (grammar_child.py), never in the engine's: measured on
SmolLM2's 49k vocabulary, a bounded repetition of a wide class such as `[^"]{0,300}` compiles for
~7-12 s to a 12 MB grammar and nested repetitions blow up without bound, and a thread that runs
past its timeout can be neither stopped nor bounded in memory (a tester's nested regex held the
one compile thread and stalled every later constraint for minutes). The child is niced, its
address space is bounded (COMPILE_MEMORY_BYTES beyond what its imports map), and a compile that
takes longer than COMPILE_TIMEOUT_S, or kills the child, is refused (`grammar_too_complex`,
cached like any failure); the child is SIGKILLed and a fresh one compiles what was queued behind.
The child returns serialize_json() text, deserialized here with this side's TokenizerInfo
(measured 48 ms + 31 ms for a 0.11 MB nested schema on 49k; a 4k vocabulary's are a few ms).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import torch

from schemas.messages import StructuredOutputs
from schemas.structured import with_format_patterns

if TYPE_CHECKING:
    import xgrammar as xgr
# xgrammar is imported where it is used: its import pulls in transformers (~5 s), which an engine
# that never sees a constraint should not pay.

log = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 10.0  # one compile, from when the child gets it; longer is refused
# What a compile may add to the child's address space (RLIMIT_AS, over what its imports already
# map: ~3 GiB of mostly reserved virtual memory for torch and xgrammar). A 300-repetition regex
# compiles to a 12 MB grammar on 49k tokens; 2 GiB is far beyond any grammar worth serving.
COMPILE_MEMORY_BYTES = 2 << 30
STARTUP_TIMEOUT_S = 120.0  # the child's imports (~5 s) and tokenizer info (~2 s on 49k), with margin on a loaded host
CACHE_SIZE = 128  # compiled grammars kept per engine, least recently used dropped first
# JSON is generated with json.dumps' separators and no other whitespace: a model cannot run on in
# free whitespace until max_tokens, and ", " / ": " are what chat models are trained on.
SEPARATORS = (", ", ": ")


class GrammarError(ValueError):
    """A spec that does not compile: `code` (invalid_schema, invalid_regex, grammar_too_complex) and
    a short message for the client."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def spec_key(spec: StructuredOutputs) -> str:
    """sha256 of the spec's canonical JSON (sorted keys): equal specs share one compiled grammar."""
    return hashlib.sha256(orjson.dumps(spec.model_dump(), option=orjson.OPT_SORT_KEYS)).hexdigest()


class Grammars:
    """The compiled grammars of one model: compiled in a child process (grammar_child.py, spawned at
    the first spec), cached (LRU) by spec_key. Failures are cached too, so a repeated bad or hostile
    spec costs nothing. One supervising thread feeds the child one spec at a time and kills it
    when a compile runs past `timeout_s` or the child dies; the step thread only polls futures."""

    def __init__(
        self,
        model_path: str | Path,
        vocab_size: int,
        stop_ids: Iterable[int],
        cache_size: int = CACHE_SIZE,
        timeout_s: float = COMPILE_TIMEOUT_S,
        memory_bytes: int = COMPILE_MEMORY_BYTES,
    ) -> None:
        self.model_path = Path(model_path)
        self.vocab_size = vocab_size  # the logits' width (config vocab), may exceed the tokenizer's
        self.stop_ids = sorted(stop_ids)
        self.cache_size = cache_size
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self._info: xgr.TokenizerInfo | None = None
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()  # the cache is read by the step thread and written by the supervisor
        self._queue: queue.SimpleQueue[tuple[StructuredOutputs, Future] | None] = queue.SimpleQueue()
        self._child: CompileChild | None = None
        self._thread: threading.Thread | None = None
        self.kills = 0  # compiles killed (timeout or death), since start
        self._is_closed = False

    def submit(self, spec: StructuredOutputs) -> Future:
        """A future of the spec's CompiledGrammar (done at once when cached); its exception is a
        GrammarError. It always resolves: each compile is bounded by timeout_s."""
        key = spec_key(spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = Future()
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            if self._thread is None:
                self._thread = threading.Thread(target=self._supervise, name="grammar", daemon=True)
                self._thread.start()
        self._queue.put((spec, future))
        return future

    def prewarm(self) -> Future:
        """Start the compile child and this side's tokenizer info in the background by compiling
        a trivial spec (cached like any): the first client constraint then finds them ready."""
        return self.submit(StructuredOutputs(choice=["ready"]))

    def compile(self, spec: StructuredOutputs, timeout_s: float | None = None) -> xgr.CompiledGrammar:
        """The spec's CompiledGrammar, waiting for it (tests, benchmarks); raises GrammarError."""
        return self.submit(spec).result(timeout=timeout_s)

    def matcher(self, compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        """A fresh matcher: one per sequence."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    @property
    def info(self) -> xgr.TokenizerInfo:
        """This side's TokenizerInfo (~2 s on a 49k vocabulary: only for a model that gets a
        constraint), which the child's serialized grammars are read with."""
        if self._info is None:
            self._info = tokenizer_info(self.model_path, self.vocab_size, self.stop_ids)
        return self._info

    def _supervise(self) -> None:
        while (item := self._queue.get()) is not None:
            spec, future = item
            if future.set_running_or_notify_cancel():
                self._compile_one(spec, future)

    def _compile_one(self, spec: StructuredOutputs, future: Future) -> None:
        """Compile `spec` on the child (a fresh one when the last was killed); a child that cannot
        start fails this spec (`grammar_error`) and the next spec tries a fresh one."""
        import xgrammar as xgr

        try:
            if self._child is None:
                self._child = CompileChild(self.model_path, self.vocab_size, self.stop_ids, self.memory_bytes)
            info = self.info  # built here while the child starts
            self._child.wait_ready()
            started = time.monotonic()
            reply = self._child.compile(spec, self.timeout_s)
        except (
            Exception
        ) as exc:  # a tokenizer.json xgrammar cannot read, a child that cannot start: ours, not the client's
            log.exception("grammar compile child failed")
            self._kill_child()
            future.set_exception(RuntimeError(f"the grammar compile process failed: {type(exc).__name__}: {exc}"))
            return
        kind, text = reply
        if kind == "ok":
            try:
                future.set_result(xgr.CompiledGrammar.deserialize_json(text, info))
            except Exception as exc:  # noqa: BLE001 - the engine refuses this request as an error (ours)
                future.set_exception(exc)
            return
        if kind == "grammar_error":  # an unexpected failure in the child (its message): ours, not the client's
            future.set_exception(RuntimeError(text))
            return
        if kind in ("timeout", "died"):
            future.set_exception(self._killed(spec, kind, text, time.monotonic() - started))
            return
        future.set_exception(GrammarError(kind, text))

    def _killed(self, spec: StructuredOutputs, kind: str, how: str, seconds: float) -> Exception:
        """Kill the child whose compile ran too long or that died; the spec's refusal."""
        self._kill_child()
        if self._is_closed:
            return RuntimeError("the grammar compiler was closed")
        log.warning(
            "grammar compile killed (%s after %.1f s): spec %s..., %s",
            kind,
            seconds,
            spec_key(spec)[:12],
            spec_kind(spec),
        )
        self.kills += 1
        why = (
            f"the constraint did not compile within {self.timeout_s:g} s"
            if kind == "timeout"
            else f"the constraint's compile ran out of memory or crashed ({how})"
        )
        return GrammarError("grammar_too_complex", f"{why}; simplify it (e.g. smaller bounded repetitions)")

    def _kill_child(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child = None

    def close(self) -> None:
        """Stop the supervisor after the spec it is on and kill the child."""
        self._is_closed = True
        self._queue.put(None)
        self._kill_child()


class CompileChild:
    """One compile process (grammar_child.py): a fresh interpreter (never a fork: the engine holds
    torch threads; and multiprocessing refuses children to the engine's own daemonic process),
    spoken to over two pipes with multiprocessing.Connection frames."""

    def __init__(self, model_path: Path, vocab_size: int, stop_ids: list[int], memory_bytes: int) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        args = [
            sys.executable,
            "-m",
            "services.worker.engine.grammar_child",
            str(to_child_r),
            str(from_child_w),
            str(os.getpid()),
            str(memory_bytes),
        ]
        root = Path(__file__).resolve().parents[3]  # the repository: the child imports services.* from it
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
        self.process = subprocess.Popen(args, pass_fds=(to_child_r, from_child_w), env=env, stdin=subprocess.DEVNULL)
        os.close(to_child_r)
        os.close(from_child_w)
        self._out = Connection(to_child_w, readable=False)
        self._in = Connection(from_child_r, writable=False)
        self._out.send((str(model_path), vocab_size, stop_ids))
        self._is_ready = False

    def wait_ready(self) -> None:
        """Return once the child's compiler is built; raise when it cannot start."""
        if self._is_ready:
            return
        if not self._in.poll(STARTUP_TIMEOUT_S):
            raise RuntimeError(f"the grammar compile process did not start within {STARTUP_TIMEOUT_S:g} s")
        kind, message = self._in.recv()  # ("ready", "") or ("error", why); EOFError: it died
        if kind != "ready":
            raise RuntimeError(message)
        self._is_ready = True

    def compile(self, spec: StructuredOutputs, timeout_s: float) -> tuple[str, str]:
        """("ok", serialized), (an error code, message), ("timeout", "") or ("died", how)."""
        self._out.send(spec.model_dump())
        try:
            if not self._in.poll(timeout_s):
                return ("timeout", "")
            return self._in.recv()
        except (EOFError, OSError):
            code = self.process.wait()
            return ("died", f"killed by signal {-code}" if code < 0 else f"exit code {code}")

    def kill(self) -> None:
        self.process.kill()  # SIGKILL: a compile in C++ does not look at signals
        self.process.wait()
        self._out.close()
        self._in.close()


def spec_kind(spec: StructuredOutputs) -> str:
    """The kind of constraint, for logs (never its text: a client's schema may be large or private)."""
    if spec.json_schema is not None:
        return "json_schema"
    return "json_object" if spec.json_object else "regex" if spec.regex is not None else "choice"


def tokenizer_info(model_path: Path, vocab_size: int, stop_ids: list[int]) -> xgr.TokenizerInfo:
    import xgrammar as xgr

    return xgr.TokenizerInfo.from_huggingface(_hf_tokenizer(model_path), vocab_size=vocab_size, stop_token_ids=stop_ids)


def compile_spec(compiler: xgr.GrammarCompiler, spec: StructuredOutputs) -> xgr.CompiledGrammar:
    """The spec's grammar (run in the compile child); raises GrammarError for an invalid one."""
    try:
        if spec.json_schema is not None:
            schema = with_format_patterns(spec.json_schema)  # date, date-time, ipv4: exact patterns
            return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=SEPARATORS)
        if spec.json_object:
            # strict_mode off: any object, with any properties (strict mode would close it to `{}`)
            return compiler.compile_json_schema(
                '{"type": "object"}', any_whitespace=False, separators=SEPARATORS, strict_mode=False
            )
        if spec.regex is not None:
            return compiler.compile_regex(spec.regex)
        return compiler.compile_grammar(choice_ebnf(spec.choice or []))
    except (RuntimeError, ValueError) as exc:
        if "bad_alloc" in str(exc):  # C++ out of memory (the child's RLIMIT_AS), not a bad spec
            raise MemoryError(str(exc)) from exc
        code = "invalid_regex" if spec.regex is not None else "invalid_schema"
        raise GrammarError(code, _short(str(exc))) from exc


def _hf_tokenizer(model_path: Path):
    from transformers import PreTrainedTokenizerFast  # a runtime dependency; imported only when a constraint comes

    return PreTrainedTokenizerFast(tokenizer_file=str(model_path / "tokenizer.json"))


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices`: each string a literal, every character
    outside printable ASCII (and `"` and `\\`) written as a \\u / \\U escape."""
    return "root ::= " + " | ".join(f'"{_ebnf_escape(c)}"' for c in choices)


def _ebnf_escape(text: str) -> str:
    out = []
    for ch in text:
        code = ord(ch)
        if 0x20 <= code < 0x7F and ch not in '"\\':
            out.append(ch)
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return "".join(out)


def _short(message: str, limit: int = 300) -> str:
    """xgrammar's message without its C++ source location prefix, cut to `limit` characters."""
    message = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", message.strip())
    return message if len(message) <= limit else message[: limit - 3] + "..."


class StepMask:
    """One bitmask for the step's rows, allocated once and reused: only constrained rows are
    filled and only they are masked, so unconstrained rows' logits are untouched."""

    def __init__(self, vocab_size: int, max_rows: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(max_rows, vocab_size)

    def apply(self, logits: torch.Tensor, matchers: list[xgr.GrammarMatcher | None]) -> None:
        """Mask `logits` [rows, width] in place: row r keeps only what matchers[r] allows (None: no constraint)."""
        constrained = [(r, m) for r, m in enumerate(matchers) if m is not None]
        if not constrained:
            return
        if len(matchers) > self.bitmask.shape[0]:
            self.bitmask = self.xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for r, matcher in constrained:
            matcher.fill_next_token_bitmask(self.bitmask, r)
        rows = [r for r, _ in constrained]
        bitmask = self.bitmask[: len(matchers)]
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        self.xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)


def is_instance(spec: StructuredOutputs, text: str) -> bool:
    """Whether `text` is an instance of the constraint, checked independently of the grammar:
    JSON parsed and validated (jsonschema_rs, formats included), a regex by Python's re.fullmatch,
    a choice by membership."""
    if spec.choice is not None:
        return text in spec.choice
    if spec.regex is not None:
        return _regex_matches(spec.regex, text)
    try:
        value: Any = json.loads(text)
    except ValueError:
        return False
    if spec.json_object or spec.json_schema is None:
        return isinstance(value, dict)
    import jsonschema_rs  # a runtime dependency, needed only when a constrained output ends

    return jsonschema_rs.validator_for(spec.json_schema, validate_formats=True).is_valid(value)


def _regex_matches(pattern: str, text: str) -> bool:
    try:
        compiled = re.compile(pattern)
    except re.error:  # a dialect Python's re does not read: ask a fresh xgrammar regex matcher
        return _xgrammar_fullmatch(pattern, text)
    return compiled.fullmatch(text) is not None


def _xgrammar_fullmatch(pattern: str, text: str) -> bool:
    import xgrammar as xgr

    grammar = xgr.Grammar.from_regex(pattern)
    info = xgr.TokenizerInfo([])  # no vocabulary: the string is matched byte by byte
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(grammar), terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_completed()


# -- closing JSON before max_tokens --------------------------------------------------------------

# A JSON lexer's states, as far as closing cares: between values, inside a string, just after a
# string's backslash, inside a number. Nesting levels are brackets, an open string and an open
# number: a level is what a token must close before the JSON can end.
OUTSIDE, IN_STRING, ESCAPED, IN_NUMBER = range(4)
NUMBER_CHARS = b"0123456789.eE+-"
NUMBER_BYTES = frozenset(NUMBER_CHARS)
# How near its budget a JSON row starts closing: within max(CLOSE_MIN_TOKENS, CLOSE_SHARE *
# max_tokens) tokens of it. Measured on SmolLM2-135M (a nested schema of 6 properties, temperature
# 0.7, max_tokens 120, seeds 0-9): unsteered 7/10 closed; steered at full bias from a quarter of
# the budget 9/10; from 0.4 of it 10/10, as with the graded bias below.
CLOSE_MIN_TOKENS = 24
CLOSE_SHARE = 0.4
# The logit added per level a token closes (subtracted per level it opens), before temperature:
# half a logit where the window starts, doubling every CLOSE_DOUBLING_TOKENS, up to CLOSE_BIAS,
# where a row takes a token that closes the most levels the grammar allows and the model's own
# preference only chooses among those. A mild start keeps what the model would have closed by
# itself (at full bias from 0.4 of the budget, that run ended every list empty; graded, 4 of the
# 10 kept 2-3 items).
CLOSE_DOUBLING_TOKENS = 3
CLOSE_BIAS = 1000.0


def lex(state: int, data: bytes) -> tuple[int, int]:
    """The lexer state after `data` from `state`, and the change in open levels it made."""
    delta = 0
    for byte in data:
        if state == ESCAPED:
            state = IN_STRING
        elif state == IN_STRING:
            if byte == 0x5C:  # backslash: the next byte is escaped, never a closing quote
                state = ESCAPED
            elif byte == 0x22:
                state, delta = OUTSIDE, delta - 1
        else:
            if state == IN_NUMBER:
                if byte in NUMBER_BYTES:
                    continue
                state, delta = OUTSIDE, delta - 1  # the number ends at the first other byte
            if byte == 0x22:
                state, delta = IN_STRING, delta + 1
            elif byte in b"[{":
                delta += 1
            elif byte in b"]}":
                delta -= 1
            elif byte in b"-0123456789":
                state, delta = IN_NUMBER, delta + 1
    return state, delta


LEXED_BYTES = re.compile(rb'["\\\[\]{}0-9-]')  # the bytes that open or close a level outside a number


def _deltas(piece: bytes) -> tuple[int, int, int, int]:
    """The change in open levels `piece` makes from each lexer state (OUTSIDE, IN_STRING, ESCAPED, IN_NUMBER). Most
    tokens are words with none of LEXED_BYTES: they change nothing, except that one with a byte
    outside NUMBER_CHARS ends an open number."""
    if LEXED_BYTES.search(piece) is None:
        return 0, 0, 0, (-1 if piece.translate(None, NUMBER_CHARS) else 0)
    return lex(OUTSIDE, piece)[1], lex(IN_STRING, piece)[1], lex(ESCAPED, piece)[1], lex(IN_NUMBER, piece)[1]


class JsonCloser:
    """Steers a JSON-constrained row toward closing as it nears max_tokens, so a model that rambles
    inside a string or a number still ends with `stop` and a valid instance (docs/design.md,
    "Structured output, tools and logprobs").

    For each lexer state, the change in open levels of every token is computed once per
    vocabulary; near the budget, a row's logits get -weight x that change, added after the
    grammar's mask: only tokens the grammar allows can win, so the output stays an instance. The
    row's state is lexed from its own output tokens and the trigger is its own position, so a
    regenerated or preempted request is steered the same way (invariant 3).
    """

    def __init__(self, pieces: list[bytes], width: int) -> None:
        """`pieces`: each token id's bytes (special tokens as their text); `width`: the logits' width."""
        self.pieces = pieces
        deltas = torch.zeros(4, width, dtype=torch.float32)
        deltas[:, : len(pieces)] = torch.tensor([_deltas(p) for p in pieces], dtype=torch.float32).T
        self.bias = -deltas  # [state, width]: levels closed
        self._on_device: torch.Tensor | None = None  # self.bias on the logits' device, copied once

    @staticmethod
    def weight(num_output: int, max_tokens: int) -> float:
        """The closing bias per level for a row with `num_output` tokens of `max_tokens`; 0 outside the window."""
        window = max(CLOSE_MIN_TOKENS, int(CLOSE_SHARE * max_tokens))
        into = window - (max_tokens - num_output)  # tokens into the window, 0 at its first
        return 0.0 if into < 0 else min(CLOSE_BIAS, 2.0 ** (into / CLOSE_DOUBLING_TOKENS - 1))

    def state_of(self, output_ids: list[int]) -> int:
        """The lexer state at the end of a row's output."""
        state = OUTSIDE
        for token in output_ids:
            state = lex(state, self.pieces[token])[0] if token < len(self.pieces) else state
        return state

    @torch.inference_mode()  # the model's logits are inference tensors: changed in place only in this mode
    def steer(self, logits: torch.Tensor, rows: list[tuple[int, list[int], float]]) -> None:
        """Add the closing bias to `logits` [rows, width] in place for each (row, its output ids, weight)."""
        bias = self.bias
        if logits.device != bias.device:
            if self._on_device is None or self._on_device.device != logits.device:
                self._on_device = bias.to(logits.device)
            bias = self._on_device
        for row, output_ids, weight in rows:
            logits[row] += bias[self.state_of(output_ids)] * weight

"""Batch jobs, the pure part: input-file parsing, the job state machine, result collection and
the output/error files in OpenAI's Batch API formats. No I/O; time is passed in.

A job's input is a JSONL file whose lines are {custom_id, method: "POST", url, body}, split and
parsed by the gateway's own code (schemas/batch_lines.py), which refused any bad line before the
file was stored. Checked again here: a line the runner cannot even identify (not JSON, no
custom_id, a repeated custom_id, another url) fails the whole job in validation, as OpenAI does;
a line whose *body* is wrong (a model removed since the upload, a bad parameter) is answered in
the error file with status 400 and the job goes on.

A line's `model` resolves like an interactive request's (planner.resolve_ref against the followed
model registry): a bare name goes to its default version and the line's request is pinned to that
`name@version`; an unknown name, an unregistered or retired version or a malformed ref is refused
in the error file. The output names the version that answered (ReplyEnd.model_version).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import orjson

from schemas.batch_lines import (
    ENDPOINT_KINDS,
    MAX_BATCH_LINES,
    Envelope,
    LineBody,
    LineError,
    iter_lines,
    parse_envelope,
    parse_line_body,
)
from schemas.messages import (
    TERMINAL_BATCH_STATUSES,
    BatchJob,
    BatchLineError,
    EmbedRequest,
    GenerateRequest,
    ReplyDelta,
    ReplyEnd,
    RequestCounts,
    TokenLogprob,
    Usage,
)
from schemas.openai_bodies import BodyError, ChatCompletionBody, CompletionBody, Kind
from schemas.openai_translate import (
    ID_PREFIX,
    EmbeddingBody,
    Routing,
    Unrankable,
    choices_usage,
    client_code,
    embedding_body,
    response_body,
    to_requests,
)
from schemas.registry import RegistryState
from schemas.reply_stream import ReplyCursor
from services.batcher.planner import resolve_ref

MAX_VALIDATION_ERRORS = 100

# Legal moves of a job's status; anything else is a bug in the runner.
TRANSITIONS: dict[str, frozenset[str]] = {
    "validating": frozenset({"in_progress", "failed", "cancelling", "expired"}),
    "in_progress": frozenset({"finalizing", "cancelling", "expired"}),
    "finalizing": frozenset({"completed", "cancelling"}),
    "cancelling": frozenset({"cancelled"}),
}
_STAMP = {
    "in_progress": "in_progress_ms",
    "finalizing": "finalizing_ms",
    "completed": "completed_ms",
    "failed": "failed_ms",
    "cancelling": "cancelling_ms",
    "cancelled": "cancelled_ms",
    "expired": "expired_ms",
}


class IllegalTransition(ValueError):
    """A status change the batch state machine does not allow."""


def transition(job: BatchJob, status: str, now_ms: int, **changes: Any) -> BatchJob:
    """`job` moved to `status` at `now_ms` (its *_ms stamp set), with `changes`; raises
    IllegalTransition for a move TRANSITIONS does not list."""
    if status != job.status and status not in TRANSITIONS.get(job.status, frozenset()):
        raise IllegalTransition(f"batch {job.job_id}: {job.status} -> {status} is not allowed")
    update = {"status": status, "updated_ms": now_ms, **changes}
    if status != job.status:
        update[_STAMP[status]] = now_ms
    return job.model_copy(update=update)


def is_terminal(job: BatchJob) -> bool:
    """True once the job can never change again."""
    return job.status in TERMINAL_BATCH_STATUSES


def request_id_of(job_id: str, custom_id: str) -> str:
    """The deterministic request id of one line: a resubmission after a restart reuses it, so the
    batcher, the worker and the result collector all see the same request."""
    return f"{job_id}.{hashlib.sha256(custom_id.encode()).hexdigest()[:24]}"


def new_file_id() -> str:
    """A fresh, unguessable file id for a job's output or error file: nothing about it follows
    from the job id (docs/design.md, "Batch files"). The runner records the ids it will use in the
    job record before writing, so one that restarts while writing rewrites the same files."""
    return f"file-{secrets.token_hex(16)}"


@dataclass(frozen=True)
class JobLine:
    """One request of a usable line of the input file, or why the line's body is refused (then
    error set and request None)."""

    line: int
    custom_id: str
    request_id: str
    model: str
    request: GenerateRequest | EmbedRequest | None
    error: BatchLineError | None = None
    # a line asking for n > 1 choices is n sibling requests `<parent_id>/<choice>` (docs/design.md,
    # "n and best_of are sibling requests"), an embedding line of more inputs than one request takes
    # is requests `<parent_id>-<part>`: answered together in one result line
    choice: int = 0
    parent_id: str | None = None
    kind: str = "chat.completions"  # the endpoint's: chat.completions, completions or embeddings
    body: LineBody | None = None  # the line's checked body (what its response is rendered for)

    @property
    def line_request_id(self) -> str:
        """The request id of the line itself (its result's): its siblings' parent, else its own."""
        return self.parent_id or self.request_id


@dataclass
class ParsedInput:
    """The lines of an input file, or the reasons it fails validation (then `errors` is not empty)."""

    lines: list[JobLine] = field(default_factory=list)
    errors: list[BatchLineError] = field(default_factory=list)


def parse_input(content: bytes, job: BatchJob, models: RegistryState, reply_to: str) -> ParsedInput:
    """Parse and check the JSONL input of `job` with the gateway's own splitter and parser
    (schemas/batch_lines.py) and translator (schemas/openai_translate.py); each request goes to
    the bulk lane, to `reply_to`, with the job's expiry as its deadline, pinned to the version its
    model resolves to in `models`. Pure and deterministic: a restart parses the same, unless the
    registry changed meanwhile (then the lines not answered yet go where a new request would)."""
    parsed = ParsedInput()
    seen: set[str] = set()
    num_rows = 0
    for number, raw in iter_lines([content]):
        num_rows += 1
        if num_rows > MAX_BATCH_LINES:
            message = f"more than {MAX_BATCH_LINES} lines; at most {MAX_BATCH_LINES} per batch"
            parsed.errors.append(BatchLineError(code="too_many_requests", message=message))
            return parsed
        try:
            envelope = parse_envelope(number, raw, seen, job.endpoint)
        except LineError as exc:
            if len(parsed.errors) < MAX_VALIDATION_ERRORS:
                parsed.errors.append(BatchLineError(code=exc.code, message=str(exc), line=exc.line, param=exc.param))
            continue
        parsed.lines.extend(to_job_lines(envelope, job, models, reply_to))
    if num_rows == 0:
        parsed.errors.append(BatchLineError(code="empty_file", message="the input file has no requests"))
    return parsed


def to_job_lines(envelope: Envelope, job: BatchJob, models: RegistryState, reply_to: str) -> list[JobLine]:
    """The JobLines of one input line: a request each, as the translator makes them for the online
    endpoint (one, a sibling per choice of n, or an embedding body's parts), or the line's refusal."""
    number, custom_id = envelope.line, envelope.custom_id
    request_id = request_id_of(job.job_id, custom_id)
    kind = ENDPOINT_KINDS[envelope.url]
    model = envelope.body.get("model")

    def refused(code: str, message: str, param: str | None = None) -> list[JobLine]:
        info = BatchLineError(code=code, message=message, line=number, param=param)
        return [JobLine(number, custom_id, request_id, str(model), None, info, kind=kind)]

    if not isinstance(model, str):
        return refused("model_not_found", f"The model {model!r} does not exist", "model")
    config, why = resolve_ref(models, model)
    if config is None:
        return refused("model_not_found", why or f"The model {model!r} does not exist", "model")
    model = config.served_id
    routing = Routing(
        request_id, reply_to, job.created_ms, job.expires_ms, job.principal, job.tenant, "bulk", stream=False
    )
    try:  # the same checks and translation as the gateway's endpoint: every parameter honoured or refused by name
        body = parse_line_body(envelope)
        requests: Sequence[GenerateRequest | EmbedRequest] = to_requests(kind, body, config, routing)
    except LineError as exc:
        return refused(exc.code, exc.message, exc.param)
    except BodyError as exc:
        return refused(exc.code, exc.message, exc.param)
    parent = request_id if len(requests) > 1 else None
    return [
        JobLine(number, custom_id, r.request_id, model, r, choice=i, parent_id=parent, kind=kind, body=body)
        for i, r in enumerate(requests)
    ]


@dataclass
class _Result:
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cursor: ReplyCursor = field(default_factory=ReplyCursor)
    end: ReplyEnd | None = None


class JobResults:
    """What the job's reply topic says so far: text and terminal event per request.

    Events may repeat (at-least-once delivery, or a request submitted again after a restart, whose
    deltas may group positions otherwise): only the positions past those kept are taken from a
    delta (schemas/reply_stream.py: ReplyCursor), and the first ReplyEnd wins.
    """

    def __init__(self, lines: list[JobLine]) -> None:
        self.lines = lines
        self._by_request = {line.request_id: line for line in lines}
        self._results: dict[str, _Result] = {}
        self.num_pending = sum(1 for line in lines if line.error is None)

    def add(self, event: ReplyDelta | ReplyEnd) -> bool:
        """Apply one reply event; returns True when it ended a request for the first time."""
        if event.request_id not in self._by_request:
            return False
        result = self._results.setdefault(event.request_id, _Result())
        part = result.cursor.take(event)
        if part is None:
            return False
        if isinstance(part, ReplyEnd):
            result.end = part
            self.num_pending -= 1
            return True
        result.text.append(part.text)
        result.logprobs.extend(part.logprobs or [])
        return False

    def is_ended(self, request_id: str) -> bool:
        """True once the request's terminal event was read (or its line was refused)."""
        line = self._by_request[request_id]
        result = self._results.get(request_id)
        return line.error is not None or (result is not None and result.end is not None)

    def pending(self) -> list[JobLine]:
        """Lines still waiting for a terminal event, in file order."""
        return [line for line in self.lines if not self.is_ended(line.request_id)]

    def _groups(self) -> list[list[JobLine]]:
        """The JobLines of each input line (its siblings, in choice order), in file order."""
        groups: dict[int, list[JobLine]] = {}
        for line in self.lines:
            groups.setdefault(line.line, []).append(line)
        return list(groups.values())

    def _ends(self, group: list[JobLine]) -> list[ReplyEnd] | None:
        """The terminal of every sibling of an input line, or None while one has not ended (or it was refused)."""
        ends = [result.end for line in group if (result := self._results.get(line.request_id)) and result.end]
        return ends if len(ends) == len(group) else None

    def counts(self) -> RequestCounts:
        """OpenAI's request_counts, one per input line: completed are responses (every choice
        finished), failed are errors."""
        completed = failed = 0
        groups = self._groups()
        for group in groups:
            if group[0].error is not None:
                failed += 1
            elif (ends := self._ends(group)) is not None:
                if all(end.finish_reason in ("stop", "length") for end in ends):
                    completed += 1
                else:
                    failed += 1
        return RequestCounts(total=len(groups), completed=completed, failed=failed)

    def usage(self) -> Usage:
        """The token counts of every request that ended, whatever its finish reason (what their
        ReplyEnds billed), summed: the job's usage. The siblings of a line count its prompt once,
        as its result does."""
        prompt = completion = cached = 0
        for group in self._groups():
            ends = [result.end for line in group if (result := self._results.get(line.request_id)) and result.end]
            if ends and group[0].kind == "embeddings":  # its parts embed different inputs
                prompt += sum(end.usage.prompt_tokens for end in ends)
            elif ends:
                body = group[0].body  # a generation body here: embeddings are the branch above
                prompts = body.num_prompts if isinstance(body, ChatCompletionBody | CompletionBody) else 1
                usage = choices_usage(ends, prompts if len(ends) == len(group) else 1)
                prompt += usage.prompt_tokens
                cached += usage.cached_prompt_tokens
                completion += usage.completion_tokens
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            cached_prompt_tokens=cached,
        )

    def files(self, endpoint: str, unfinished_code: str | None = None) -> tuple[str, str]:
        """(output JSONL, error JSONL) in file order, one line per custom_id. Lines not ended get
        an error line with `unfinished_code` (cancelled or expired jobs), or are left out. A line
        with n choices is a response once every sibling finished, else the first failure's error."""
        out: list[bytes] = []
        errors: list[bytes] = []
        for group in self._groups():
            line = group[0]
            ends = self._ends(group)
            if line.error is not None:
                errors.append(_error_line(line, 400, {"error": line.error.model_dump(mode="json")}))
            elif ends is None:
                if unfinished_code is not None:
                    info: dict[str, Any] = {
                        "code": unfinished_code,
                        "message": f"the request did not run: the batch was {unfinished_code.split('_')[-1]}",
                    }
                    errors.append(
                        orjson.dumps(
                            {
                                "id": f"batch_req_{line.line_request_id}",
                                "custom_id": line.custom_id,
                                "response": None,
                                "error": info,
                            }
                        )
                    )
            elif all(end.finish_reason in ("stop", "length") for end in ends):
                results = [self._results[sibling.request_id] for sibling in group]
                try:
                    texts = ["".join(r.text) for r in results]
                    body = line_response_body(line, texts, ends, [r.logprobs for r in results])
                except Unrankable as exc:  # as the gateway answers it: 502
                    info = {"code": "cumulative_logprob_missing", "message": str(exc), "type": "server_error"}
                    errors.append(_error_line(line, 502, {"error": info}))
                    continue
                out.append(
                    orjson.dumps(
                        {
                            "id": f"batch_req_{line.line_request_id}",
                            "custom_id": line.custom_id,
                            "response": {"status_code": 200, "request_id": line.line_request_id, "body": body},
                            "error": None,
                        }
                    )
                )
            else:
                end = next(end for end in ends if end.finish_reason not in ("stop", "length"))
                info = (
                    end.error.model_dump(mode="json")
                    if end.error
                    else {"code": end.finish_reason, "message": end.finish_reason}
                )
                info["code"] = client_code(info.get("code"))  # as the gateway answers it online
                status = {"timeout": 408, "rejected": 400, "cancelled": 499}.get(end.finish_reason, 500)
                errors.append(
                    _error_line(
                        line,
                        status,
                        {"error": {**info, "type": "invalid_request_error" if status < 500 else "server_error"}},
                    )
                )
        return _jsonl(out), _jsonl(errors)


def _error_line(line: JobLine, status: int, body: dict[str, Any]) -> bytes:
    return orjson.dumps(
        {
            "id": f"batch_req_{line.line_request_id}",
            "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": line.line_request_id, "body": body},
            "error": None,
        }
    )


def _jsonl(rows: list[bytes]) -> str:
    return "".join(row.decode() + "\n" for row in rows)


def line_response_body(
    line: JobLine, texts: list[str], ends: list[ReplyEnd], logprobs: list[list[TokenLogprob]] | None = None
) -> dict[str, Any]:
    """The body the synchronous endpoint would have answered for `line` (the translator's, as the
    gateway renders it): a chat.completion, text_completion or embedding list, from its
    requests' texts and terminals in order."""
    assert line.request is not None and line.body is not None
    if isinstance(line.body, EmbeddingBody):
        return embedding_body(line.request.model, ends, line.body.encoding_format)
    kind = cast(Kind, line.kind)
    return response_body(
        kind,
        f"{ID_PREFIX[kind]}{line.line_request_id}",
        cast(GenerateRequest, line.request),
        line.body,
        texts,
        ends,
        logprobs,
    )

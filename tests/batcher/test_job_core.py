"""Batch jobs, pure part: input parsing, the state machine, result collection, output files."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from schemas.messages import BatchJob, ErrorInfo, ReplyDelta, ReplyEnd, Usage, sibling_seed
from schemas.model_repo import load_model_repo
from schemas.registry import RegistryState
from services.batcher.job_core import (
    IllegalTransition,
    JobResults,
    new_file_id,
    request_id_of,
    transition,
)
from services.batcher.job_core import parse_input as parse_input_bytes
from weir.files import FileHeader, FileIndex, chunk_file

REPO = RegistryState(load_model_repo(Path(__file__).parents[2] / "models.toml"))  # the seed: echo -> echo@1
T0 = 1_767_225_600_000


def parse_input(text: str, *args: object):  # the runner parses the file's bytes
    return parse_input_bytes(text.encode(), *args)


def make_job(endpoint: str = "/v1/chat/completions", status: str = "validating") -> BatchJob:
    return BatchJob(
        job_id="batch_1",
        status=status,
        endpoint=endpoint,
        input_file_id="file-1",
        created_ms=T0,
        expires_ms=T0 + 86_400_000,
        updated_ms=T0,
    )


def chat_line(custom_id: str, content: str = "hello", **body: object) -> str:
    return orjson.dumps(
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "echo", "messages": [{"role": "user", "content": content}], **body},
        }
    ).decode()


def test_lines_become_bulk_requests_with_deterministic_ids():
    text = "\n".join([chat_line("a", max_tokens=7, temperature=0), chat_line("b"), ""])
    parsed = parse_input(text, make_job(), REPO, "weir.replies.job.batch_1")
    assert parsed.errors == []
    first = parsed.lines[0].request
    assert first is not None and first.priority == "bulk" and first.max_tokens == 7 and first.temperature == 0
    assert first.reply_to == "weir.replies.job.batch_1" and first.deadline_ms == T0 + 86_400_000
    assert first.request_id == request_id_of("batch_1", "a") != request_id_of("batch_1", "b")
    assert parse_input(text, make_job(), REPO, "r").lines[0].request_id == first.request_id  # a restart parses the same


@pytest.mark.parametrize(
    "bad, code",
    [
        ("{not json", "invalid_json"),
        ('{"method": "POST", "url": "/v1/chat/completions", "body": {}}', "missing_custom_id"),
        (chat_line("a"), "duplicate_custom_id"),
        ('{"custom_id": "z", "method": "POST", "url": "/v1/completions", "body": {}}', "mismatched_url"),
        ('{"custom_id": "z", "method": "GET", "url": "/v1/chat/completions", "body": {}}', "invalid_method"),
    ],
)
def test_unidentifiable_lines_fail_validation_with_a_reason_and_line(bad, code):
    parsed = parse_input(chat_line("a") + "\n" + bad + "\n", make_job(), REPO, "r")
    assert [(e.code, e.line) for e in parsed.errors] == [(code, 2)]


def test_empty_file_fails_validation():
    assert [e.code for e in parse_input("\n\n", make_job(), REPO, "r").errors] == ["empty_file"]


def test_bad_bodies_go_to_the_error_file_and_the_job_goes_on():
    text = "\n".join([chat_line("ok"), chat_line("m", model="nope"), chat_line("t", temperature=9)])
    parsed = parse_input(text, make_job(), REPO, "r")
    assert parsed.errors == []
    assert [(ln.custom_id, ln.error.code if ln.error else None) for ln in parsed.lines] == [
        ("ok", None),
        ("m", "model_not_found"),
        ("t", "invalid_value"),
    ]
    results = JobResults(parsed.lines)
    assert [ln.custom_id for ln in results.pending()] == ["ok"]
    assert results.counts().model_dump() == {"total": 3, "completed": 0, "failed": 2}
    _out, errors = results.files("/v1/chat/completions")
    rows = [orjson.loads(r) for r in errors.splitlines()]
    assert [(r["custom_id"], r["response"]["status_code"]) for r in rows] == [("m", 400), ("t", 400)]
    assert rows[1]["response"]["body"]["error"]["param"] == "temperature"


def test_lines_carry_penalties_and_logit_bias():
    parsed = parse_input(
        chat_line("p", presence_penalty=0.5, frequency_penalty=-1, logit_bias={"3": -100}), make_job(), REPO, "r"
    )
    request = parsed.lines[0].request
    assert request is not None
    assert (request.presence_penalty, request.frequency_penalty, request.logit_bias) == (0.5, -1.0, {"3": -100.0})


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"presence_penalty": 5}, "invalid_value", "presence_penalty"),
        ({"frequency_penalty": "1"}, "invalid_value", "frequency_penalty"),
        ({"logit_bias": {"x": 1}}, "invalid_value", "logit_bias"),
        ({"response_format": {"type": "json_schema"}}, "invalid_value", "response_format"),
        ({"logprobs": "yes"}, "invalid_value", "logprobs"),
        ({"tools": [{"type": "function"}]}, "missing_required_parameter", "tools.0.function"),
        ({"function_call": "auto"}, "unsupported_parameter", "function_call"),
        ({"repetition_penalty": 1.1}, "unknown_parameter", "repetition_penalty"),
        ({"timeout_s": 5}, "unsupported_parameter", "timeout_s"),
        ({"n": 17}, "invalid_value", "n"),
        (
            {"n": 2, "top_logprobs": 2},
            "invalid_value",
            "top_logprobs",
        ),  # logprobs themselves run (test_translate_parity.py)
    ],
)
def test_a_line_refuses_what_the_gateway_refuses_naming_the_parameter(body, code, param):
    parsed = parse_input(chat_line("ok") + "\n" + chat_line("bad", **body), make_job(), REPO, "r")
    assert parsed.errors == [] and parsed.lines[0].error is None
    error = parsed.lines[1].error
    assert error is not None and (error.code, error.param, error.line) == (code, param, 2)


def test_a_completions_line_may_wrap_its_prompt_in_a_list():
    line = orjson.dumps(
        {
            "custom_id": "c",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "echo", "prompt": ["x"], "user": "u"},
        }
    ).decode()
    request = parse_input(line, make_job("/v1/completions"), REPO, "r").lines[0].request
    assert request is not None and request.prompt == "x"


def test_results_drop_repeats_and_write_each_custom_id_once():
    parsed = parse_input("\n".join(chat_line(c, c) for c in "abc"), make_job(), REPO, "r")
    results = JobResults(parsed.lines)
    ra, rb, rc = (ln.request_id for ln in parsed.lines)
    events = [
        ReplyDelta(request_id=ra, seq=0, text="a"),
        ReplyEnd(
            request_id=ra,
            seq=1,
            finish_reason="stop",
            usage=Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2),
        ),
        # regenerated after a crash: the same events again, and a second end
        ReplyDelta(request_id=ra, seq=0, text="a"),
        ReplyEnd(request_id=ra, seq=1, finish_reason="stop"),
        ReplyEnd(request_id=rb, seq=0, finish_reason="rejected", error=ErrorInfo(code="x", message="y")),
        ReplyEnd(request_id="someone-else", seq=0, finish_reason="stop"),
    ]
    assert [results.add(e) for e in events] == [False, True, False, False, True, False]
    assert [ln.request_id for ln in results.pending()] == [rc] and results.num_pending == 1
    assert results.counts().model_dump() == {"total": 3, "completed": 1, "failed": 1}
    out, errors = results.files("/v1/chat/completions", unfinished_code="batch_cancelled")
    out_rows = [orjson.loads(r) for r in out.splitlines()]
    assert [r["custom_id"] for r in out_rows] == ["a"]
    body = out_rows[0]["response"]["body"]
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "a"
    assert body["usage"]["total_tokens"] == 2 and out_rows[0]["response"]["status_code"] == 200
    err_rows = [orjson.loads(r) for r in errors.splitlines()]
    assert [(r["custom_id"], (r["error"] or {}).get("code")) for r in err_rows] == [
        ("b", None),
        ("c", "batch_cancelled"),
    ]
    assert out == results.files("/v1/chat/completions", unfinished_code="batch_cancelled")[0]  # deterministic


def test_results_take_each_position_once_when_a_rerun_coalesces_otherwise():
    from schemas.codec import encode
    from services.batcher.jobs import _fast_reply

    parsed = parse_input(chat_line("a", "a"), make_job(), REPO, "r")
    results = JobResults(parsed.lines)
    rid = parsed.lines[0].request_id
    first = [ReplyDelta(request_id=rid, seq=0, count=3, text="one two", texts=["one", " two", ""], token_ids=[1, 2, 3])]
    rerun = [
        ReplyDelta(request_id=rid, seq=0, text="one", token_ids=[1]),
        ReplyDelta(
            request_id=rid,
            seq=1,
            count=4,
            text=" two three.",
            texts=[" two", "", " three", "."],
            token_ids=[2, 3, 4, 5],
        ),
        ReplyEnd(request_id=rid, seq=5, finish_reason="stop"),
    ]
    # as the runner reads them: bytes off the job's reply topic (the first run broke after its first record)
    for event in first + rerun:
        results.add(_fast_reply(encode(event)))
    body = orjson.loads(results.files("/v1/chat/completions")[0])["response"]["body"]
    assert body["choices"][0]["message"]["content"] == "one two three."


def test_completions_endpoint_takes_prompts_and_answers_text_completions():
    line = orjson.dumps(
        {"custom_id": "p", "url": "/v1/completions", "body": {"model": "echo", "prompt": ["x y"]}}
    ).decode()
    parsed = parse_input(line, make_job("/v1/completions"), REPO, "r")
    assert parsed.lines[0].request is not None and parsed.lines[0].request.prompt == "x y"
    results = JobResults(parsed.lines)
    results.add(ReplyDelta(request_id=parsed.lines[0].request_id, seq=0, text="x y"))
    results.add(ReplyEnd(request_id=parsed.lines[0].request_id, seq=1, finish_reason="length"))
    body = orjson.loads(results.files("/v1/completions")[0])["response"]["body"]
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "x y"


def test_state_machine_allows_only_openai_moves_and_stamps_times():
    job = transition(make_job(), "in_progress", T0 + 5)
    assert job.in_progress_ms == T0 + 5 and job.updated_ms == T0 + 5
    job = transition(transition(job, "finalizing", T0 + 6), "completed", T0 + 7, output_file_id="f")
    assert (job.status, job.completed_ms, job.output_file_id) == ("completed", T0 + 7, "f")
    for status in ("in_progress", "cancelling", "failed"):
        with pytest.raises(IllegalTransition):
            transition(job, status, T0 + 8)
    cancelled = transition(transition(make_job(status="in_progress"), "cancelling", T0 + 1), "cancelled", T0 + 2)
    assert (cancelled.cancelling_ms, cancelled.cancelled_ms) == (T0 + 1, T0 + 2)
    with pytest.raises(IllegalTransition):
        transition(make_job(status="in_progress"), "failed", T0)
    with pytest.raises(IllegalTransition):
        transition(make_job(), "completed", T0)


def test_files_chunk_on_character_boundaries_and_reassemble():
    data = ("é" * 10 + "\n").encode() * 30
    chunks = chunk_file(FileHeader("file-x", "x.jsonl", "batch", "acme", "key", "ann", T0), data, max_chunk_bytes=7)
    assert len(chunks) > 40 and all(len(c.data.encode()) <= 7 for c in chunks)
    index = FileIndex()
    for chunk in reversed(chunks[1:]):
        index.add(chunk)
    assert index.get("file-x") is None  # incomplete
    index.add(chunks[0])
    index.add(chunks[3])  # a repeat
    stored = index.get("file-x")
    assert stored is not None and stored.content() == data and stored.first.num_bytes == len(data)
    assert b"".join(stored.pieces()) == data
    assert stored.is_owned_by("acme", "key", "ann") and not stored.is_owned_by("acme", "key", "bob")
    assert not stored.is_owned_by("acme", "jwt", "ann")  # a JWT whose subject is ann is someone else
    assert not stored.is_owned_by("other", "key", "ann")


def test_result_file_ids_are_random_not_derived_from_the_batch():
    ids = {new_file_id() for _ in range(100)}
    assert len(ids) == 100 and all(i.startswith("file-") and len(i) == len("file-") + 32 for i in ids)
    assert not any("batch" in i for i in ids)


def test_lines_are_split_at_newline_only_and_other_separators_stay_in_the_line():
    # U+2028 inside a JSON string: one line whose text holds it, not a second, smuggled line.
    smuggled = chat_line("a", "x\u2028" + chat_line("b"))
    parsed = parse_input(smuggled + "\r\n" + chat_line("c") + "\n", make_job(), REPO, "r")
    assert parsed.errors == [] and [ln.custom_id for ln in parsed.lines] == ["a", "c"]
    # U+2028 between two lines is no line break: the line is not JSON and fails validation.
    between = chat_line("a") + "\u2028" + chat_line("b", model="weir-tiny-py")
    assert [(e.code, e.line) for e in parse_input(between, make_job(), REPO, "r").errors] == [("invalid_json", 1)]


def test_lines_resolve_like_requests_pinned_to_a_version_and_the_output_names_the_one_that_answered():
    text = "\n".join(
        [
            chat_line("bare"),
            chat_line("pin", model="echo@1"),
            chat_line("unreg", model="echo@9"),
            chat_line("empty", model="echo@"),
            chat_line("noname", model="@1"),
            chat_line("spaces", model="echo@bad version!"),
        ]
    )
    parsed = parse_input(text, make_job(), REPO, "r")
    assert parsed.errors == []
    lines = {ln.custom_id: ln for ln in parsed.lines}
    assert lines["bare"].request is not None and lines["bare"].request.model == lines["bare"].model == "echo@1"
    assert lines["pin"].request is not None and lines["pin"].request.model == "echo@1"
    refused = {
        cid: ln.error.message
        for cid, ln in lines.items()
        if ln.error is not None and ln.error.code == "model_not_found"
    }
    assert set(refused) == {"unreg", "empty", "noname", "spaces"}
    assert "'echo@9' is not registered" in refused["unreg"] and "names no model" in refused["noname"]
    assert "is not 'name@version'" in refused["empty"] and "is not 'name@version'" in refused["spaces"]
    results = JobResults([lines["bare"]])
    results.add(ReplyEnd(request_id=lines["bare"].request_id, seq=0, finish_reason="stop", model_version="echo@1"))
    out, _ = results.files("/v1/chat/completions")
    assert orjson.loads(out.splitlines()[0])["response"]["body"]["model"] == "echo@1"


def test_the_jobs_usage_sums_each_requests_end_once_whatever_it_finished_with():
    parsed = parse_input("\n".join(chat_line(c, c) for c in "abc"), make_job(), REPO, "r")
    results = JobResults(parsed.lines)
    ra, rb, _ = (ln.request_id for ln in parsed.lines)
    assert results.usage() == Usage()  # nothing ended yet
    end_a = ReplyEnd(
        request_id=ra,
        seq=1,
        finish_reason="stop",
        usage=Usage(prompt_tokens=12, completion_tokens=5, total_tokens=17, cached_prompt_tokens=8),
    )
    end_b = ReplyEnd(request_id=rb, seq=3, finish_reason="length", usage=Usage(prompt_tokens=4, completion_tokens=9))
    for event in (end_a, end_a, end_b, ReplyEnd(request_id=rb, seq=4, finish_reason="stop", usage=end_a.usage)):
        results.add(event)  # a repeated end, and a second end of b: counted once, the first wins
    assert results.usage() == Usage(prompt_tokens=16, completion_tokens=14, total_tokens=30, cached_prompt_tokens=8)


def test_a_line_with_n_choices_is_n_sibling_requests_answered_in_one_result_line():
    parsed = parse_input("\n".join([chat_line("a", n=2, seed=3), chat_line("b")]), make_job(), REPO, "r")
    parent = request_id_of("batch_1", "a")
    assert [(ln.request_id, ln.custom_id, ln.choice) for ln in parsed.lines[:2]] == [
        (f"{parent}/0", "a", 0),
        (f"{parent}/1", "a", 1),
    ]
    assert [ln.request.seed for ln in parsed.lines[:2] if ln.request] == [3, sibling_seed(3, 1)]
    results = JobResults(parsed.lines)
    usage = Usage(prompt_tokens=4, completion_tokens=1, total_tokens=5)
    for i, text in enumerate("xy"):
        results.add(ReplyDelta(request_id=f"{parent}/{i}", seq=0, text=text))
    results.add(ReplyEnd(request_id=f"{parent}/1", seq=1, finish_reason="stop", usage=usage))
    assert results.counts().model_dump() == {"total": 2, "completed": 0, "failed": 0}  # choice 0 still runs
    results.add(ReplyEnd(request_id=f"{parent}/0", seq=1, finish_reason="length", usage=usage))
    assert results.counts().model_dump() == {"total": 2, "completed": 1, "failed": 0}
    row = orjson.loads(results.files("/v1/chat/completions")[0].splitlines()[0])
    assert (row["custom_id"], row["id"], row["response"]["request_id"]) == ("a", f"batch_req_{parent}", parent)
    body = row["response"]["body"]
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "x", "length"),
        (1, "y", "stop"),
    ]
    assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (4, 2)  # the prompt once
    assert results.usage() == Usage(prompt_tokens=4, completion_tokens=2, total_tokens=6)

"""Files and Batch API shapes, without a broker: multipart parsing as the openai client sends it,
batch and file objects that the openai client's own types accept, and the checks of an upload, a
new batch and a page of batches."""

from __future__ import annotations

import orjson
import pytest
from openai.types import Batch, FileObject

from schemas.messages import BatchJob, BatchLineError, RequestCounts, Usage
from services.gateway.batch_format import (
    FileSummary,
    batch_object,
    batch_page,
    check_batch_body,
    check_batch_quota,
    file_object,
    file_page,
    new_batch_job,
    redact_result_line,
)
from services.gateway.guard.auth import Identity
from services.gateway.openai_format import ApiError
from weir.files import FileHeader, chunk_file

ANN = Identity(principal="ann", tenant="acme", scope="key:ann")
BOB = Identity(principal="bob", tenant="acme", scope="key:bob")

T0 = 1_767_225_600_000


def test_batch_and_file_objects_validate_as_the_openai_client_types():
    job = BatchJob(
        job_id="batch_1",
        status="failed",
        endpoint="/v1/completions",
        input_file_id="file-1",
        request_counts=RequestCounts(total=2),
        created_ms=T0,
        expires_ms=T0 + 86_400_000,
        failed_ms=T0 + 1000,
        errors=[BatchLineError(code="invalid_json", message="no", line=2)],
        metadata={"k": "v"},
        updated_ms=T0,
    )
    batch = Batch.model_validate(batch_object(job))
    assert (batch.status, batch.failed_at, batch.errors.data[0].line) == ("failed", T0 // 1000 + 1, 2)
    assert batch.request_counts.total == 2 and batch.metadata == {"k": "v"} and batch.usage is None
    done = job.model_copy(
        update={
            "status": "completed",
            "completed_ms": T0 + 2000,
            "usage": Usage(prompt_tokens=30, completion_tokens=12, cached_prompt_tokens=16),
        }
    )
    usage = Batch.model_validate(batch_object(done)).usage
    assert (usage.input_tokens, usage.input_tokens_details.cached_tokens, usage.output_tokens, usage.total_tokens) == (
        30,
        16,
        12,
        42,
    )
    first = chunk_file(FileHeader("file-1", "in.jsonl", "batch", "acme", "key", "ann", T0), b"x\n")[0]
    assert FileObject.model_validate(file_object(first)).bytes == 2


GOOD_BODY = {"endpoint": "/v1/chat/completions", "input_file_id": "file-1", "completion_window": "24h"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([GOOD_BODY], None),
        ({**GOOD_BODY, "endpoint": "/v1/responses"}, "endpoint"),
        ({**GOOD_BODY, "completion_window": "1h"}, "completion_window"),
        ({**GOOD_BODY, "metadata": "k=v"}, "metadata"),
        ({**GOOD_BODY, "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ],
)
def test_a_batch_body_is_refused_naming_the_field_at_fault(body, param):
    with pytest.raises(ApiError) as caught:
        check_batch_body(body)
    assert (caught.value.status, caught.value.param) == (400, param)


def test_a_new_batch_is_validating_and_due_by_the_end_of_its_window():
    body = check_batch_body({**GOOD_BODY, "metadata": {"run": 7}})
    job = new_batch_job(body, "batch_1", ANN, FileSummary(3, 12, 300), T0)  # 3 lines, n=4 each
    assert (job.status, job.endpoint, job.input_file_id, job.principal, job.tenant) == (
        "validating",
        "/v1/chat/completions",
        "file-1",
        "ann",
        "acme",
    )
    assert (job.request_counts.total, job.queued_requests, job.queued_tokens) == (3, 12, 300)
    assert (job.created_ms, job.expires_ms, job.updated_ms, job.metadata) == (T0, T0 + 86_400_000, T0, {"run": "7"})


def job(job_id: str, tenant: str, created_ms: int, principal: str = "ann", **fields: object) -> BatchJob:
    fields = {"status": "validating", "credential": "key", **fields}
    return BatchJob(
        job_id=job_id,
        endpoint="/v1/completions",
        input_file_id="file-1",
        tenant=tenant,
        principal=principal,
        created_ms=created_ms,
        expires_ms=created_ms + 86_400_000,
        updated_ms=created_ms,
        **fields,
    )


def test_a_page_of_batches_is_the_owners_newest_first_after_a_cursor():
    jobs = [
        job("b1", "acme", T0),
        job("b2", "acme", T0 + 1),
        job("x1", "other", T0 + 2),
        job("b3", "acme", T0 + 3),
        job("y1", "acme", T0 + 4, principal="bob"),
    ]
    first = batch_page(jobs, ANN, 2, None)
    assert [b["id"] for b in first["data"]] == ["b3", "b2"]
    assert (first["first_id"], first["last_id"], first["has_more"]) == ("b3", "b2", True)
    rest = batch_page(jobs, ANN, 2, "b2")
    assert ([b["id"] for b in rest["data"]], rest["has_more"]) == (["b1"], False)
    assert [b["id"] for b in batch_page(jobs, BOB, 10, None)["data"]] == ["y1"]  # same tenant, another principal
    assert batch_page(jobs, ANN, 2, "y1")["data"] == []  # another's batch is no cursor either
    assert batch_page(jobs, ANN, 2, "unknown") == {
        "object": "list",
        "data": [],
        "first_id": None,
        "last_id": None,
        "has_more": False,
    }


@pytest.mark.parametrize("limit", [0, 101])
def test_a_page_limit_outside_1_to_100_is_a_400(limit):
    with pytest.raises(ApiError) as caught:
        batch_page([], ANN, limit, None)
    assert (caught.value.status, caught.value.param) == (400, "limit")


def test_a_page_of_files_is_the_owners_only():
    def first(
        file_id: str, tenant: str, principal: str, created_ms: int, purpose: str = "batch", credential: str = "key"
    ) -> object:
        return chunk_file(FileHeader(file_id, "f.jsonl", purpose, tenant, credential, principal, created_ms), b"x\n")[0]

    files = [
        first("f1", "acme", "ann", T0),
        first("f2", "acme", "bob", T0 + 1),
        first("f3", "other", "ann", T0 + 2),
        first("f4", "acme", "ann", T0 + 3, "batch_output"),
        first("f5", "acme", "ann", T0 + 4, credential="jwt"),
    ]  # a JWT whose subject is ann: someone else
    page = file_page(files, ANN, None, 10, "desc", None)
    assert [f["id"] for f in page["data"]] == ["f4", "f1"] and page["has_more"] is False
    assert [f["id"] for f in file_page(files, ANN, "batch", 10, "asc", None)["data"]] == ["f1"]
    with pytest.raises(ApiError) as caught:
        file_page(files, ANN, None, 10, "sideways", None)
    assert caught.value.param == "order"


def test_the_batch_quota_counts_the_owners_live_batches_and_the_keys_minute_limits():
    live = [
        job("b1", "acme", T0, request_counts={"total": 60}, queued_tokens=6000),
        job("b2", "acme", T0, status="completed", request_counts={"total": 10_000}, queued_tokens=10**9),
        job("b3", "acme", T0, principal="bob", request_counts={"total": 10_000}, queued_tokens=10**9),
    ]
    check_batch_quota(live, ANN, FileSummary(40, 40, 4000), max_requests=100, max_tokens=10_000)  # exactly at the quota
    for summary, kind in (
        (FileSummary(41, 41, 10), "requests"),
        (FileSummary(1, 1, 4001), "tokens"),
        (FileSummary(3, 41, 10), "requests"),
    ):  # 3 lines of n=16 (as 41 requests) pass it too
        with pytest.raises(ApiError) as caught:
            check_batch_quota(live, ANN, summary, max_requests=100, max_tokens=10_000)
        assert (caught.value.status, caught.value.code) == (
            429,
            "batch_quota_exceeded",
        ) and kind in caught.value.message
    # A key limited to 1 token a minute may queue a day's worth: 1440 tokens, whatever the deployment allows.
    limited = Identity(principal="cy", tenant="acme", scope="key:cy", max_tokens_per_min=1)
    check_batch_quota([], limited, FileSummary(1, 1, 1440), max_requests=100, max_tokens=10**9)
    with pytest.raises(ApiError):
        check_batch_quota([], limited, FileSummary(1, 1, 1441), max_requests=100, max_tokens=10**9)
    # a live batch's requests are its queued requests (n per line), not its lines
    many = [job("b4", "acme", T0, request_counts={"total": 5}, queued_requests=80, queued_tokens=1)]
    with pytest.raises(ApiError) as caught:
        check_batch_quota(many, ANN, FileSummary(21, 21, 1), max_requests=100, max_tokens=10**9)
    assert "101 requests" in caught.value.message


def test_the_batch_quota_of_a_jwt_subject_is_its_own_in_each_tenant():
    zed_globex = Identity(principal="zed", tenant="globex", scope="sub:globex:zed")
    zed_acme = Identity(principal="zed", tenant="acme", scope="sub:acme:zed")
    live = [
        job("g1", "globex", T0, principal="zed", credential="jwt", request_counts={"total": 100}),
        job("k1", "acme", T0, principal="zed", request_counts={"total": 100}),
    ]  # an API key of principal zed
    with pytest.raises(ApiError):
        check_batch_quota(live, zed_globex, FileSummary(1, 1, 1), max_requests=100, max_tokens=10_000)
    check_batch_quota(live, zed_acme, FileSummary(100, 100, 1), max_requests=100, max_tokens=10_000)


def test_result_lines_pass_the_guards_function_on_the_models_text_only():
    line = orjson.dumps(
        {
            "id": "batch_req_1",
            "custom_id": "call 555-0100",
            "response": {
                "status_code": 200,
                "request_id": "r",
                "body": {
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": "mail ann@example.com"}},
                        {"index": 1, "text": "ann@example.com"},
                    ]
                },
            },
            "error": None,
        }
    )
    row = orjson.loads(redact_result_line(line, lambda text: text.replace("ann@example.com", "[REDACTED]")))
    choices = row["response"]["body"]["choices"]
    assert (choices[0]["message"]["content"], choices[1]["text"]) == ("mail [REDACTED]", "[REDACTED]")
    assert row["custom_id"] == "call 555-0100"  # the caller's own id is not model output
    error_line = b'{"id": "x", "custom_id": "c", "response": null, "error": {"code": "batch_expired"}}'
    assert redact_result_line(error_line, str.upper) == error_line

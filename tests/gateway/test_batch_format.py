"""Files and Batch API shapes, without a broker: multipart parsing as the openai client sends it,
batch and file objects that the openai client's own types accept, and the checks of an upload, a
new batch and a page of batches."""

from __future__ import annotations

import httpx
import pytest
from openai.types import Batch, FileObject

from schemas.messages import BatchJob, BatchLineError, RequestCounts
from services.gateway.batch_format import (
    MAX_FILE_BYTES,
    batch_object,
    batch_page,
    batch_upload,
    check_batch_body,
    file_object,
    models_in,
    new_batch_job,
    parse_multipart,
)
from services.gateway.openai_format import ApiError
from weir.files import chunk_file

T0 = 1_767_225_600_000


def multipart(files: dict, data: dict) -> tuple[str, bytes]:
    request = httpx.Request("POST", "http://x/v1/files", files=files, data=data)
    return request.headers["content-type"], request.read()


def test_multipart_upload_as_the_openai_client_sends_it():
    content = '{"custom_id": "a"}\n{"custom_id": "é"}\n'.encode()
    ctype, body = multipart({"file": ("in.jsonl", content, "application/octet-stream")}, {"purpose": "batch"})
    fields, upload = parse_multipart(ctype, body)
    assert fields == {"purpose": "batch"} and upload == ("in.jsonl", content)


def test_non_multipart_upload_is_a_400():
    with pytest.raises(ApiError) as caught:
        parse_multipart("application/json", b"{}")
    assert caught.value.status == 400


def test_batch_and_file_objects_validate_as_the_openai_client_types():
    job = BatchJob(job_id="batch_1", status="failed", endpoint="/v1/completions", input_file_id="file-1",
                   request_counts=RequestCounts(total=2), created_ms=T0, expires_ms=T0 + 86_400_000,
                   failed_ms=T0 + 1000, errors=[BatchLineError(code="invalid_json", message="no", line=2)],
                   metadata={"k": "v"}, updated_ms=T0)
    batch = Batch.model_validate(batch_object(job))
    assert (batch.status, batch.failed_at, batch.errors.data[0].line) == ("failed", T0 // 1000 + 1, 2)
    assert batch.request_counts.total == 2 and batch.metadata == {"k": "v"}
    first = chunk_file("file-1", "in.jsonl", "batch", b"x\n", T0)[0]
    assert FileObject.model_validate(file_object(first)).bytes == 2


def test_models_named_by_a_file_are_found_for_authorization():
    assert models_in(b'{"body": {"model": "echo"}}\n{oops\n[1]\n{"body": {"model": "x"}}\n') == {"echo", "x"}


def test_an_upload_needs_purpose_batch_and_a_file_part():
    content = b'{"custom_id": "a"}\n'
    assert batch_upload(*multipart({"file": ("in.jsonl", content)}, {"purpose": "batch"})) == ("in.jsonl", content)
    wrong_purpose = multipart({"file": ("in.jsonl", content)}, {"purpose": "fine-tune"})
    no_file = multipart({"notes": ("notes.txt", b"hi")}, {"purpose": "batch"})
    for (ctype, body), param in [(wrong_purpose, "purpose"), (no_file, "file")]:
        with pytest.raises(ApiError) as caught:
            batch_upload(ctype, body)
        assert (caught.value.status, caught.value.param) == (400, param)


def test_an_upload_over_the_limit_is_a_413_before_it_is_parsed():
    with pytest.raises(ApiError) as caught:
        batch_upload("application/json", b"x" * (MAX_FILE_BYTES + 1))
    assert (caught.value.status, caught.value.code) == (413, "request_too_large")


GOOD_BODY = {"endpoint": "/v1/chat/completions", "input_file_id": "file-1", "completion_window": "24h"}


@pytest.mark.parametrize(("body", "param"), [
    ([GOOD_BODY], None),
    ({**GOOD_BODY, "endpoint": "/v1/embeddings"}, "endpoint"),
    ({**GOOD_BODY, "completion_window": "1h"}, "completion_window"),
    ({**GOOD_BODY, "metadata": "k=v"}, "metadata"),
    ({**GOOD_BODY, "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
])  # fmt: skip
def test_a_batch_body_is_refused_naming_the_field_at_fault(body, param):
    with pytest.raises(ApiError) as caught:
        check_batch_body(body)
    assert (caught.value.status, caught.value.param) == (400, param)


def test_a_new_batch_is_validating_and_due_by_the_end_of_its_window():
    body = check_batch_body({**GOOD_BODY, "metadata": {"run": 7}})
    job = new_batch_job(body, "batch_1", "ann", "acme", T0)
    assert (job.status, job.endpoint, job.input_file_id, job.principal, job.tenant) == (
        "validating", "/v1/chat/completions", "file-1", "ann", "acme")
    assert (job.created_ms, job.expires_ms, job.updated_ms, job.metadata) == (T0, T0 + 86_400_000, T0, {"run": "7"})


def job(job_id: str, tenant: str, created_ms: int) -> BatchJob:
    return BatchJob(job_id=job_id, status="validating", endpoint="/v1/completions", input_file_id="file-1",
                    tenant=tenant, created_ms=created_ms, expires_ms=created_ms + 86_400_000, updated_ms=created_ms)


def test_a_page_of_batches_is_the_tenants_newest_first_after_a_cursor():
    jobs = [job("b1", "acme", T0), job("b2", "acme", T0 + 1), job("x1", "other", T0 + 2), job("b3", "acme", T0 + 3)]
    first = batch_page(jobs, "acme", 2, None)
    assert [b["id"] for b in first["data"]] == ["b3", "b2"]
    assert (first["first_id"], first["last_id"], first["has_more"]) == ("b3", "b2", True)
    rest = batch_page(jobs, "acme", 2, "b2")
    assert ([b["id"] for b in rest["data"]], rest["has_more"]) == (["b1"], False)
    assert batch_page(jobs, "acme", 2, "unknown") == {
        "object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}


@pytest.mark.parametrize("limit", [0, 101])
def test_a_page_limit_outside_1_to_100_is_a_400(limit):
    with pytest.raises(ApiError) as caught:
        batch_page([], "acme", limit, None)
    assert (caught.value.status, caught.value.param) == (400, "limit")

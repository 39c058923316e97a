"""Files and Batch API shapes, without a broker: multipart parsing as the openai client sends it,
and batch and file objects that the openai client's own types accept."""

from __future__ import annotations

import httpx
import pytest
from openai.types import Batch, FileObject

from schemas.messages import BatchJob, BatchLineError, RequestCounts
from services.gateway.batch_api import batch_object, file_object, models_in, parse_multipart
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

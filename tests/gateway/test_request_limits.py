"""The limits every request meets before a route reads it (services/gateway/request_limits.py):
the JSON depth scanner against a reference on generated JSON, and the header checks."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.openai_format import ApiError
from services.gateway.request_limits import check_headers, check_json_depth, json_depth


def reference_depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((reference_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((reference_depth(v) for v in value), default=0)
    return 0


# Strings full of what could fool a scanner: brackets, quotes, backslashes, escapes.
tricky = st.text(alphabet=st.sampled_from(list('[]{}"\\/ au\u2028\x00é')), max_size=12)
scalars = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False)
)
values = st.recursive(
    scalars | tricky,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(tricky, inner, max_size=4),
    max_leaves=40,
)


@settings(max_examples=200, deadline=None)
@given(value=values)
def test_the_scanner_agrees_with_the_parsed_depth(value: Any) -> None:
    texts = (orjson.dumps(value), json.dumps(value, ensure_ascii=False).encode(), json.dumps(value, indent=1).encode())
    for raw in texts:
        assert json_depth(raw) == reference_depth(value)


@pytest.mark.parametrize(
    ("raw", "depth"),
    [
        (b"1", 0),
        (b'"[[["', 0),
        (b"[]", 1),
        (b'{"a": [1, {"b": "]]"}]}', 3),
        (rb'["\\", "[", "\"[["]', 1),
        (rb'["\\\\\"[", []]', 2),
        (b"[" * 5000 + b"]" * 5000, 5000),
        (b"[[[", 3),
        (b"]]]", 0),
    ],
)
def test_depth_of_known_texts(raw: bytes, depth: int) -> None:
    assert json_depth(raw) == depth


def test_check_json_depth_refuses_past_the_limit_only() -> None:
    check_json_depth(b"[" * 64 + b"]" * 64, 64)
    check_json_depth(b'["' + b"[" * 500 + b'"]', 64)  # in a string: not nesting
    with pytest.raises(ApiError) as refused:
        check_json_depth(b"[" * 65 + b"]" * 65, 64)
    assert (refused.value.status, refused.value.code) == (400, "json_too_deep")


def test_header_checks() -> None:
    check_headers([(b"a", b"b")] * 100, 100, 1000)
    with pytest.raises(ApiError) as too_many:
        check_headers([(b"a", b"b")] * 101, 100, 1000)
    with pytest.raises(ApiError) as too_large:
        check_headers([(b"a", b"b" * 1000)], 100, 1000)
    for refused in (too_many, too_large):
        assert (refused.value.status, refused.value.code) == (431, "request_header_fields_too_large")

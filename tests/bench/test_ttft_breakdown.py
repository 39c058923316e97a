"""The pipeline bench's hop breakdown: joining client marks with what the records say."""

from __future__ import annotations

import orjson

from bench.ttft_breakdown import HOPS, ClientMark, _take, hop_rows
from schemas.codec import encode
from schemas.messages import Batch, GenerateRequest, ReplyDelta, ReplyEnd, Usage


def request(rid: str) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid, model="m", prompt="p", max_tokens=4, deadline_ms=10**13, reply_to="r", created_ms=1001
    )


def stamps_of(records: list[tuple[bytes, int]]) -> dict[str, dict[str, float]]:
    stamps: dict[str, dict[str, float]] = {}
    for value, timestamp in records:
        _take(orjson.loads(value), timestamp, stamps)
    return stamps


def test_hops_split_ttft_at_each_record() -> None:
    end = ReplyEnd(
        request_id="r1",
        seq=3,
        finish_reason="stop",
        received_ms=1010,
        usage=Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3),
    )
    records = [
        (encode(request("r1")), 1002),
        (encode(Batch(batch_id="b", model="m", requests=[request("r1")], batcher_id="x")), 1005),
        (encode(ReplyDelta(request_id="r1", seq=0, text="", token_ids=[5])), 1016),  # no text: not shown yet
        (encode(ReplyDelta(request_id="r1", seq=1, text="def", token_ids=[6])), 1018),
        (encode(ReplyDelta(request_id="r1", seq=2, text=" x", token_ids=[7])), 1020),
        (encode(end), 1021),
    ]
    rows, num = hop_rows([ClientMark("r1", 1000.0, 1021.0), ClientMark("lost", 0.0, 5.0)], stamps_of(records))
    assert num == 1  # a request with no records is left out
    assert [r[0] for r in rows] == [*HOPS, "total (client TTFT)"]
    # the gateway splits at the request's created_ms (accepted at 1001, produced at 1002)
    assert [float(r[1]) for r in rows] == [1.0, 1.0, 3.0, 5.0, 8.0, 3.0, 21.0]

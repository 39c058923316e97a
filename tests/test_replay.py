"""weir replay, pure part: time parsing, outcome collection, the diff rows and summary."""

from __future__ import annotations

from schemas.messages import GenerateRequest, ReplyDelta, ReplyEnd
from weir.replay import Outcome, diff_rows, parse_time_ms


def outcome(*texts: str, finish: str = "stop") -> Outcome:
    result = Outcome()
    for seq, text in enumerate(texts):
        result.add(ReplyDelta(request_id="r", seq=seq, text=text))
        result.add(ReplyDelta(request_id="r", seq=seq, text=text))  # a repeat is dropped
    result.add(ReplyEnd(request_id="r", seq=len(texts), finish_reason=finish))
    return result


def test_an_outcome_keeps_each_position_once_however_its_runs_coalesced():
    result = Outcome()
    result.add(ReplyDelta(request_id="r", seq=0, count=2, text="ab", texts=["a", "b"], token_ids=[1, 2]))
    result.add(ReplyDelta(request_id="r", seq=0, text="a", token_ids=[1]))  # the rerun, one position a delta
    result.add(ReplyDelta(request_id="r", seq=1, count=2, text="bc", texts=["b", "c"], token_ids=[2, 3]))
    result.add(ReplyEnd(request_id="r", seq=3, finish_reason="stop"))
    assert "".join(result.text) == "abc" and result.end is not None


def test_times_are_iso_utc_or_epoch_ms():
    assert parse_time_ms("2026-01-01T00:00:00Z") == parse_time_ms("2026-01-01T00:00:00") == 1_767_225_600_000
    assert parse_time_ms("2026-01-01T01:00:00+01:00") == 1_767_225_600_000
    assert parse_time_ms("1767225600000") == 1_767_225_600_000


def test_diff_rows_compare_texts_and_summarise():
    requests = [
        GenerateRequest(request_id=f"q{i}", model="a", prompt=f"p{i}", deadline_ms=1, reply_to="t") for i in range(3)
    ]
    before = {"q0": outcome("x", "y"), "q1": outcome("x")}
    after = {"q0": outcome("xy"), "q1": outcome("z"), "q2": outcome("w")}
    rows = diff_rows(requests, before, after, "b", with_prompts=False)
    assert [(r["original_text"], r["new_text"], r["is_equal"]) for r in rows[:-1]] == [
        ("xy", "xy", True),
        ("x", "z", False),
        (None, "w", False),
    ]
    assert "prompt" not in rows[0] and len(rows[0]["prompt_sha256"]) == 64
    assert rows[-1] == {
        "summary": True,
        "new_model": "b",
        "num_requests": 3,
        "num_equal": 1,
        "num_different": 1,
        "num_missing_original": 1,
        "num_missing_new": 0,
    }

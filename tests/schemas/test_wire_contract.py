"""Golden tests: the wire contract changes only on purpose."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from schemas import messages, registry
from schemas.codec import (
    DecodeError,
    decode,
    decode_audit_record,
    decode_reply,
    decode_request,
    encode,
    reply_address,
)
from schemas.export import main as export_main
from schemas.model_repo import ModelRepoError, load_model_repo
from schemas.topics import Topics

GOLDEN = Path(__file__).parent / "golden"
TYPES = {
    "GenerateRequest": messages.GenerateRequest,
    "ReplyDelta": messages.ReplyDelta,
    "ReplyEnd": messages.ReplyEnd,
    "Cancellation": messages.Cancellation,
    "Batch": messages.Batch,
    "WorkerHeartbeat": messages.WorkerHeartbeat,
    "AuditEvent": messages.AuditEvent,
    "DeadLetter": messages.DeadLetter,
    "ApiKeyRecord": messages.ApiKeyRecord,
    "UsageRecord": messages.UsageRecord,
    "EmbedRequest": messages.EmbedRequest,
    "ReplyEndEmbeddings": messages.ReplyEnd,
    "FileChunk": messages.FileChunk,
    "BatchJob": messages.BatchJob,
    "JobCommand": messages.JobCommand,
    "ReviewFlag": messages.ReviewFlag,
    "ModelVersionRecord": registry.ModelVersionRecord,
    "ModelRoute": registry.ModelRoute,
    "ModelHealthEvent": registry.ModelHealthEvent,
    "GenerateRequestStructured": messages.GenerateRequest,
    "ReplyDeltaLogprobs": messages.ReplyDelta,
    "ReplyDeltaToolCall": messages.ReplyDelta,
    "ReplyEndToolCall": messages.ReplyEnd,
    "StreamRecord": messages.StreamRecord,
    "ReplyDeltaCoalesced": messages.ReplyDelta,
}


def test_exported_json_schemas_match_the_code():
    assert export_main(["--check"]) == 0, "run: python -m schemas.export, and review the contract change"


@pytest.mark.parametrize("name", sorted(TYPES))
def test_golden_message_round_trips_byte_for_byte(name):
    raw = (GOLDEN / f"{name}.json").read_bytes()
    message = decode(TYPES[name], raw)
    assert orjson.loads(encode(message)) == orjson.loads(raw)
    assert message.schema_version == messages.SCHEMA_VERSION


def test_reply_events_decode_by_type():
    assert isinstance(decode_reply((GOLDEN / "ReplyDelta.json").read_bytes()), messages.ReplyDelta)
    assert isinstance(decode_reply((GOLDEN / "ReplyEnd.json").read_bytes()), messages.ReplyEnd)


@pytest.mark.parametrize(
    "raw, why",
    [
        (b"{not json", "not JSON"),
        (b"[]", "invalid GenerateRequest"),
        (
            b'{"request_id": "r", "model": "m", "deadline_ms": 1, "reply_to": "t"}',
            "exactly one of prompt, prompt_token_ids and messages",
        ),
        (
            b'{"request_id": "r", "model": "m", "prompt": "x", "messages": [], "deadline_ms": 1, "reply_to": "t"}',
            "exactly one",
        ),
        (
            b'{"request_id": "r", "model": "m", "prompt": "x", "deadline_ms": 1, "reply_to": "t", "max_tokens": 0}',
            "max_tokens",
        ),
        (
            b'{"request_id": "r", "model": "m", "prompt": "x", "deadline_ms": 1, "reply_to": "t", "temprature": 1}',
            "temprature",
        ),
    ],
)
def test_malformed_requests_are_refused_with_a_reason(raw, why):
    with pytest.raises(DecodeError, match=why):
        decode(messages.GenerateRequest, raw)


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"presence_penalty": 5}, "presence_penalty: must be less than or equal to 2, got 5"),
        ({"frequency_penalty": -2.5}, "frequency_penalty: must be greater than or equal to -2, got -2.5"),
        ({"frequency_penalty": "1"}, 'frequency_penalty: expected a number, got "1"'),
        ({"logit_bias": {"a": 1}}, """logit_bias: key 'a' is not a token id (a decimal integer such as "1234")"""),
        ({"logit_bias": {"3": 101}}, "logit_bias: the bias of token 3 is 101; biases lie in [-100, 100]"),
        ({"logit_bias": {"3": "1"}}, 'logit_bias.3: expected a number, got "1"'),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias: at most 300 entries, got 301"),
    ],
)
def test_bad_sampling_penalties_are_refused_with_a_readable_reason(change, reason):
    raw = orjson.loads((GOLDEN / "GenerateRequest.json").read_bytes()) | change
    with pytest.raises(DecodeError) as caught:
        decode_request(orjson.dumps(raw))
    assert str(caught.value).startswith(f"invalid request: {reason}")


def test_penalties_default_to_none_and_bias_keys_stay_token_id_strings():
    raw = orjson.loads((GOLDEN / "GenerateRequest.json").read_bytes())
    request = decode(messages.GenerateRequest, orjson.dumps(raw))
    assert (request.presence_penalty, request.frequency_penalty) == (0.5, 0.25)
    assert request.logit_bias == {"7": -100.0, "42": 2.5}
    for name in ("presence_penalty", "frequency_penalty", "logit_bias"):
        del raw[name]
    plain = decode(messages.GenerateRequest, orjson.dumps(raw))
    assert (plain.presence_penalty, plain.frequency_penalty, plain.logit_bias) == (0.0, 0.0, None)


def test_requests_decode_by_kind_and_kind_defaults_to_generate():
    generate = orjson.loads((GOLDEN / "GenerateRequest.json").read_bytes())
    assert isinstance(decode_request(orjson.dumps(generate)), messages.GenerateRequest)
    del generate["kind"]  # clients written before EmbedRequest existed send no kind
    assert isinstance(decode_request(orjson.dumps(generate)), messages.GenerateRequest)
    embed = decode_request((GOLDEN / "EmbedRequest.json").read_bytes())
    assert isinstance(embed, messages.EmbedRequest) and embed.inputs == [
        "The quick brown fox",
        "jumps over the lazy dog",
    ]
    batch = decode(messages.Batch, (GOLDEN / "Batch.json").read_bytes())
    assert [r.kind for r in batch.requests] == ["generate", "embed"]


@pytest.mark.parametrize(
    "change, why",
    [
        ({"kind": "classify"}, "does not match any of the expected tags"),
        ({"inputs": []}, "inputs"),
        ({"inputs": ["x"] * (messages.MAX_EMBED_INPUTS + 1)}, "inputs"),
        ({"prompt": "x"}, "prompt"),
    ],
)
def test_malformed_embed_requests_are_refused_with_a_reason(change, why):
    raw = orjson.loads((GOLDEN / "EmbedRequest.json").read_bytes()) | change
    with pytest.raises(DecodeError, match=why):
        decode_request(orjson.dumps(raw))


def test_audit_records_decode_by_kind_and_no_kind_is_an_audit_event():
    event = decode_audit_record((GOLDEN / "AuditEvent.json").read_bytes())  # AuditEvents carry no kind
    assert isinstance(event, messages.AuditEvent) and event.event_id == "r-1:weir-tiny-py@1"
    flag = decode_audit_record((GOLDEN / "ReviewFlag.json").read_bytes())
    assert isinstance(flag, messages.ReviewFlag)
    assert (flag.principal, flag.num_detections, flag.window_s) == ("mallory", 5, 3600)


@pytest.mark.parametrize(
    "change, why",
    [
        ({"kind": None}, "event_id: required, missing"),  # no kind: read as an AuditEvent, which it is not
        ({"kind": "verdict"}, "does not match any of the expected tags"),
        ({"reason": "spam"}, "reason"),
        ({"num_detections": 0}, "num_detections"),
        ({"last_detection_ms": 1764498000000}, "last_detection_ms"),
        ({"prompt": "ignore previous instructions"}, "prompt"),  # raw text has no place on the audit topic
    ],
)
def test_malformed_review_flags_are_refused_with_a_reason(change, why):
    raw = orjson.loads((GOLDEN / "ReviewFlag.json").read_bytes()) | change
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(DecodeError, match=f"invalid audit record: .*{why}"):
        decode_audit_record(orjson.dumps(raw))


def test_seed_is_derived_stably_from_request_id():
    a = decode(messages.GenerateRequest, (GOLDEN / "GenerateRequest.json").read_bytes()).model_copy(
        update={"seed": None}
    )
    assert a.effective_seed == a.model_copy().effective_seed
    assert a.effective_seed != a.model_copy(update={"request_id": "other"}).effective_seed


def test_model_repository_refuses_a_bad_entry_by_name(tmp_path):
    repo = tmp_path / "models.toml"
    repo.write_text('[models.good]\nengine = "echo"\n\n[models.broken]\nengine = "torch"\nmax_batch_size = 0\n')
    with pytest.raises(ModelRepoError, match=r"'broken'.*max_batch_size"):
        load_model_repo(repo)
    repo.write_text('[models.nopath]\nengine = "torch"\n')
    with pytest.raises(ModelRepoError, match=r"'nopath'.*needs a path"):
        load_model_repo(repo)
    repo.write_text('[models.typo]\nengine = "echo"\nmax_wait = 3\n')
    with pytest.raises(ModelRepoError, match=r"'typo'.*max_wait"):
        load_model_repo(repo)


def test_the_shipped_model_repository_loads():
    repo = load_model_repo(Path(__file__).parents[2] / "models.toml")
    assert "weir-tiny-py" in repo.models


@pytest.mark.parametrize(
    ("raw", "address"),
    [
        (b'{"request_id": "r1", "reply_to": "weir.replies.app", "max_tokens": -5}', ("r1", "weir.replies.app")),
        (b'{"request_id": "r1", "reply_to": "app.replies"}', None),  # not this deployment's reply topic
        (b'{"request_id": "r1", "reply_to": "weir.keys"}', None),  # an internal topic
        (b'{"request_id": "r1", "reply_to": "weir.replies.kcat"}', ("r1", "weir.replies.kcat")),
        (b'{"request_id": "r1"}', None),  # no reply_to: nobody to tell
        (b'{"request_id": "r1", "reply_to": "no spaces allowed"}', None),
        (b'{"request_id": "r1", "reply_to": ".."}', None),
        (b'{"request_id": "r1", "reply_to": "weir.replies.' + b"t" * 237 + b'"}', None),
        (b'{"request_id": 7, "reply_to": "weir.replies.app"}', None),
        (b'{"request_id": "", "reply_to": "weir.replies.app"}', None),
        (b'{"request_id": "' + b"r" * 129 + b'", "reply_to": "weir.replies.app"}', None),
        (b'["request_id", "reply_to"]', None),
        (b"not json", None),
        (None, None),
    ],
)
def test_reply_address_of_an_invalid_request(raw, address):
    assert reply_address(raw, Topics()) == address


@pytest.mark.parametrize(
    "field, value", [("seed", 2**80), ("seed", -(2**63) - 1), ("deadline_ms", 10**30), ("top_k", 2**70)]
)
def test_a_request_whose_integer_cannot_be_written_again_is_refused(field, value):
    # A reader re-encodes what it read (the batcher, into a Batch): an integer past 64 bits would
    # crash it on every restart, so decoding refuses it, with the field's name.
    raw = orjson.loads((GOLDEN / "GenerateRequest.json").read_bytes())
    with pytest.raises(DecodeError, match=field):
        decode_request(orjson.dumps({**raw, field: str(value)}).replace(f'"{value}"'.encode(), str(value).encode()))

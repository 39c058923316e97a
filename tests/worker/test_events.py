"""What an engine output becomes on the wire: reply events and the AuditEvent. Pure, no broker."""

from __future__ import annotations

from schemas.codec import encode
from schemas.fingerprint import key_id, keyed_hmac
from schemas.messages import ErrorInfo, ReplyDelta, ReplyEnd, StructuredOutputs, TokenLogprob
from services.worker.kafka.events import audit_event, model_version, params_sha256, reply_events, shadow_live

from .factories import T0_MS, make_embed_request, make_model_config, make_output, make_request

KEY = b"k" * 32
TINY = make_model_config("tiny", version="3")


def test_model_version_is_name_at_version() -> None:
    assert model_version(TINY) == "tiny@3"


def test_a_text_delta_is_one_reply_delta_with_the_outputs_seq() -> None:
    request = make_request(model="tiny")
    [delta] = reply_events(request, "b1", make_output(request.request_id, 4, text=" add", token_ids=[7]), "tiny@3")
    assert isinstance(delta, ReplyDelta)
    assert (delta.request_id, delta.batch_id, delta.seq, delta.text, delta.token_ids) == (
        request.request_id,
        "b1",
        4,
        " add",
        [7],
    )


def test_tokens_without_text_still_make_a_delta_before_the_end() -> None:
    request = make_request(model="tiny")
    [delta] = reply_events(request, "b1", make_output(request.request_id, 2, token_ids=[9]), "tiny@3")
    assert isinstance(delta, ReplyDelta) and delta.text == "" and delta.token_ids == [9]
    assert reply_events(request, "b1", make_output(request.request_id, 2), "tiny@3") == []


def test_a_final_output_with_text_is_a_delta_then_the_end_numbered_after_it() -> None:
    request = make_request(model="tiny")
    out = make_output(
        request.request_id,
        5,
        text="!",
        token_ids=[3],
        finish_reason="stop",
        prompt_tokens=4,
        completion_tokens=6,
        received_ms=T0_MS,
        first_token_ms=T0_MS + 10,
    )
    delta, end = reply_events(request, "b1", out, "tiny@3")
    assert isinstance(delta, ReplyDelta) and isinstance(end, ReplyEnd)
    assert (delta.seq, end.seq) == (5, 6)
    assert end.finish_reason == "stop" and end.model_version == "tiny@3" and end.batch_id == "b1"
    assert (end.usage.prompt_tokens, end.usage.completion_tokens, end.usage.total_tokens) == (4, 6, 10)
    assert (end.received_ms, end.first_token_ms) == (T0_MS, T0_MS + 10)


def test_an_output_of_several_tokens_covers_their_positions_its_text_on_the_last() -> None:
    # tokens 7 and 8 released nothing (an incomplete character, a possible stop string): 9's step released it all
    request = make_request(model="tiny")
    [delta] = reply_events(request, "b1", make_output(request.request_id, 4, text="é!", token_ids=[7, 8, 9]), "tiny@3")
    assert (delta.seq, delta.count, delta.end, delta.texts, delta.token_ids) == (4, 3, 7, ["", "", "é!"], [7, 8, 9])


def test_text_only_the_end_released_is_a_tail_position_and_the_end_follows_it() -> None:
    # held back until an end-of-sequence token, which is no output token: a position with no token
    request = make_request(model="tiny")
    out = make_output(request.request_id, 6, text="\n", finish_reason="stop", completion_tokens=6)
    delta, end = reply_events(request, "b1", out, "tiny@3")
    assert (delta.seq, delta.count, delta.token_ids, delta.text, end.seq) == (6, 1, [], "\n", 7)


def test_the_tokens_of_a_final_output_without_text_keep_their_positions_and_logprobs() -> None:
    # the tokens that made a stop string have no text (the stop string is cut), yet they were
    # generated and counted: each keeps its position and its logprob entry
    request = make_request(model="tiny", logprobs=0)
    entries = [
        TokenLogprob(token_id=5, token="\ufffd", bytes=[0xF0, 0x9F], logprob=-0.5),
        TokenLogprob(token_id=6, token="\ufffd", bytes=[0x98], logprob=-0.25),
    ]
    out = make_output(
        request.request_id, 6, token_ids=[5, 6], finish_reason="stop", completion_tokens=8, logprobs=entries
    )
    delta, end = reply_events(request, "b1", out, "tiny@3")
    assert isinstance(delta, ReplyDelta) and isinstance(end, ReplyEnd)
    assert (delta.seq, delta.count, delta.texts, delta.token_ids, delta.logprobs) == (6, 2, ["", ""], [5, 6], entries)
    assert end.seq == 8 == end.usage.completion_tokens


def test_a_final_output_without_text_is_the_end_alone_with_its_error_or_vectors() -> None:
    request = make_embed_request("a", "b")
    out = make_output(request.request_id, 0, token_ids=[1], finish_reason="stop", embeddings=[[1.0], [0.0]])
    [end] = reply_events(request, "b2", out, "minilm@1")
    assert isinstance(end, ReplyEnd) and end.seq == 0 and end.embeddings == [[1.0], [0.0]]
    late = ErrorInfo(code="deadline_exceeded", message="deadline passed before the model ran")
    [end] = reply_events(
        request, "b2", make_output(request.request_id, 0, finish_reason="timeout", error=late), "minilm@1"
    )
    assert isinstance(end, ReplyEnd) and end.finish_reason == "timeout" and end.error == late


def test_the_audit_event_holds_keyed_hmacs_and_the_sampling_not_the_text() -> None:
    request = make_request(
        "def secret():",
        model="tiny",
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        max_tokens=12,
        seed=123,
        principal="alice",
        tenant="acme",
        created_ms=T0_MS,
    )
    out = make_output(
        request.request_id,
        3,
        finish_reason="length",
        prompt_tokens=4,
        completion_tokens=12,
        received_ms=T0_MS + 2,
        first_token_ms=T0_MS + 9,
        finished_ms=T0_MS + 40,
        prompt_text="def secret():",
        output_text=" return 42",
        mean_token_entropy=1.5,
        watermark_z=0.25,
    )
    event = audit_event(request, out, TINY, weights_sha256="ab" * 32, worker_id="w1", audit_key=KEY, now_ms=T0_MS + 99)
    assert event.event_id == f"{request.request_id}:tiny@3" and event.model_version == "tiny@3"
    assert (event.prompt_hmac, event.output_hmac) == (keyed_hmac(KEY, "def secret():"), keyed_hmac(KEY, " return 42"))
    assert event.hmac_key_id == key_id(KEY)
    assert (event.temperature, event.top_p, event.top_k, event.max_tokens, event.seed) == (0.7, 0.9, 40, 12, 123)
    assert (event.principal, event.tenant, event.worker_id, event.weights_sha256) == ("alice", "acme", "w1", "ab" * 32)
    assert (event.request_created_ms, event.received_ms, event.first_token_ms, event.finished_ms) == (
        T0_MS,
        T0_MS + 2,
        T0_MS + 9,
        T0_MS + 40,
    )
    assert (event.mean_token_entropy, event.watermark_z, event.finish_reason) == (1.5, 0.25, "length")
    assert event.prompt_simhash is None and event.fingerprint_model is None
    assert b"secret" not in encode(event) and b"return 42" not in encode(event)


def test_an_audit_event_takes_now_for_missing_times_and_zeros_for_an_embedding() -> None:
    request = make_embed_request("x", model="minilm")
    out = make_output(request.request_id, 0, finish_reason="rejected", prompt_text="", output_text="")
    event = audit_event(
        request,
        out,
        make_model_config("minilm", engine="onnx"),
        weights_sha256="0" * 64,
        worker_id="w1",
        audit_key=KEY,
        now_ms=T0_MS + 5,
    )
    assert (event.received_ms, event.finished_ms, event.first_token_ms) == (T0_MS + 5, T0_MS + 5, None)
    assert (event.temperature, event.top_p, event.top_k, event.max_tokens, event.seed) == (0.0, 1.0, 0, 0, 0)
    assert event.model_version == "minilm@1"


def test_only_a_final_live_answer_with_mirrors_makes_a_shadow_live() -> None:
    live = make_request(model="tiny", assignment="canary", mirrors=["4"])
    final = make_output(
        live.request_id,
        5,
        finish_reason="stop",
        completion_tokens=5,
        output_text="a b c",
        received_ms=T0_MS,
        first_token_ms=T0_MS + 40,
        finished_ms=T0_MS + 240,
    )
    published = shadow_live(live, final, [1, 2, 3, 4, 5], "tiny@3")
    assert published is not None
    assert (published.request_id, published.model, published.assignment, published.text, published.token_ids) == (
        live.request_id,
        "tiny@3",
        "canary",
        "a b c",
        [1, 2, 3, 4, 5],
    )
    assert published.ttft_ms == 40 and published.tokens_per_s == 20.0  # 4 tokens after the first in 200 ms
    assert shadow_live(make_request(model="tiny"), final, [1], "tiny@3") is None  # not mirrored
    copy = make_request(model="tiny", assignment="mirror", shadow_of="x", mirrors=[])
    assert shadow_live(copy, final, [1], "tiny@3") is None
    assert shadow_live(live, make_output(live.request_id, 0, text="a"), [1], "tiny@3") is None  # not the end
    no_times = shadow_live(live, make_output(live.request_id, 0, finish_reason="error"), [], "tiny@3")
    assert no_times is not None and no_times.ttft_ms is None and no_times.tokens_per_s is None


def test_audit_events_carry_assignment_and_shadow_of() -> None:
    copy = make_request(model="tiny", assignment="mirror", shadow_of="live-1")
    out = make_output(copy.request_id, 1, finish_reason="stop", prompt_text="p", output_text="o")
    event = audit_event(copy, out, TINY, weights_sha256="0" * 64, worker_id="w", audit_key=KEY, now_ms=T0_MS)
    assert (event.assignment, event.shadow_of) == ("mirror", "live-1")


def test_params_sha256_changes_with_what_changes_the_text_and_only_with_that() -> None:
    base = dict(model="tiny", prompt="def f():", temperature=0.8, seed=5, max_tokens=8)
    h = params_sha256(make_request(**base))
    assert len(h) == 64 and h == params_sha256(make_request(**base, principal="bob", logprobs=3, priority="bulk"))
    for change in (
        {"seed": 6},
        {"temperature": 0.9},
        {"max_tokens": 9},
        {"stop": ["\n"]},
        {"logit_bias": {"3": 1}},
        {"structured": StructuredOutputs(regex="[a-z]+")},
        {"presence_penalty": 0.5},
    ):
        assert params_sha256(make_request(**{**base, **change})) != h, change
    unseeded = {k: v for k, v in base.items() if k != "seed"}  # the effective seed: derived from request_id
    assert params_sha256(make_request(**unseeded, request_id="a")) != params_sha256(
        make_request(**unseeded, request_id="b")
    )
    # greedy: neither the seed nor top_p/top_k can change the tokens
    greedy = {**unseeded, "temperature": 0.0}
    assert params_sha256(make_request(**greedy, request_id="a")) == params_sha256(
        make_request(**greedy, top_k=5, request_id="b")
    )


def test_the_audit_event_carries_the_structured_check_and_the_params_hash() -> None:
    request = make_request(model="tiny", structured=StructuredOutputs(json_object=True), seed=1)
    out = make_output(
        request.request_id, 0, finish_reason="stop", structured_valid=False, prompt_text="p", output_text="{"
    )
    event = audit_event(request, out, TINY, weights_sha256="ab" * 32, worker_id="w1", audit_key=KEY, now_ms=T0_MS)
    assert event.structured_valid is False and event.params_sha256 == params_sha256(request)
    assert ReplyEnd.model_fields["structured_valid"] is not None  # the same field the reply carries
    embed = make_embed_request("a")
    out = make_output(embed.request_id, 0, finish_reason="stop", embeddings=[[1.0]])
    event = audit_event(embed, out, TINY, weights_sha256="ab" * 32, worker_id="w1", audit_key=KEY, now_ms=T0_MS)
    assert event.structured_valid is None and event.params_sha256 is None

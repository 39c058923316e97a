"""The refusal rules: which requests end before the model runs, and how. Pure, no broker."""

from __future__ import annotations

from services.worker.kafka.refusals import Refusal, refusal, unsupported_kind

from .factories import T0_MS, make_embed_request, make_model_config, make_request

TINY = make_model_config("tiny")
MINILM = make_model_config("minilm", engine="onnx")
ECHO = make_model_config("echo", engine="echo", path=None)


def test_a_live_request_of_the_right_model_and_kind_runs() -> None:
    assert refusal(make_request(model="tiny", deadline_ms=T0_MS + 1), TINY, T0_MS, set()) is None
    assert refusal(make_request(model="echo", deadline_ms=T0_MS + 1), ECHO, T0_MS, set()) is None
    assert refusal(make_embed_request("a", model="minilm"), MINILM, T0_MS, set()) is None


def test_a_request_for_another_model_is_rejected() -> None:
    refused = refusal(make_request(model="other", deadline_ms=T0_MS + 1), TINY, T0_MS, set())
    assert refused is not None
    assert refused.finish_reason == "rejected" and refused.error.code == "wrong_model"
    assert "tiny" in refused.error.message and "other" in refused.error.message


def test_the_wrong_kind_for_the_model_is_rejected_with_the_reason() -> None:
    embed_on_llm = refusal(make_embed_request("a", model="tiny"), TINY, T0_MS, set())
    generate_on_embedder = refusal(make_request(model="minilm", deadline_ms=T0_MS + 1), MINILM, T0_MS, set())
    assert embed_on_llm == Refusal("rejected", unsupported_kind(make_embed_request(model="tiny"), TINY))
    assert embed_on_llm is not None and "embedding model (engine onnx)" in embed_on_llm.error.message
    assert generate_on_embedder is not None and generate_on_embedder.error.code == "unsupported_request_kind"
    assert "serves EmbedRequests (kind=embed) only" in generate_on_embedder.error.message


def test_a_cancelled_request_ends_cancelled() -> None:
    request = make_request(model="tiny", deadline_ms=T0_MS + 1)
    refused = refusal(request, TINY, T0_MS, {request.request_id})
    assert refused is not None and (refused.finish_reason, refused.error.code) == ("cancelled", "cancelled")
    assert refusal(request, TINY, T0_MS, {"someone-else"}) is None


def test_a_request_at_or_past_its_deadline_times_out() -> None:
    for deadline_ms in (T0_MS, T0_MS - 1):
        refused = refusal(make_request(model="tiny", deadline_ms=deadline_ms), TINY, T0_MS, set())
        assert refused is not None
        assert (refused.finish_reason, refused.error.code) == ("timeout", "deadline_exceeded")


def test_the_first_rule_that_applies_wins() -> None:
    expired_cancelled = make_request(model="tiny", deadline_ms=T0_MS - 1)
    refused = refusal(expired_cancelled, TINY, T0_MS, {expired_cancelled.request_id})
    assert refused is not None and refused.finish_reason == "cancelled"  # cancelled before expired
    wrong_everything = make_embed_request(model="other", deadline_ms=T0_MS - 1)
    refused = refusal(wrong_everything, TINY, T0_MS, {wrong_everything.request_id})
    assert refused is not None and refused.error.code == "wrong_model"  # the model before anything else


def test_a_request_may_name_the_version_it_was_resolved_to() -> None:
    assert refusal(make_request(model="tiny@1", deadline_ms=T0_MS + 1), TINY, T0_MS, set()) is None
    refused = refusal(make_request(model="tiny@2", deadline_ms=T0_MS + 1), TINY, T0_MS, set())
    assert refused is not None and refused.error.code == "wrong_model" and "tiny@1" in refused.error.message


def test_a_client_request_under_the_golden_prefix_is_refused() -> None:
    from services.worker.engine.contract import GOLDEN_ID_PREFIX

    request = make_request(request_id=f"{GOLDEN_ID_PREFIX}0-0")
    refused = refusal(request, make_model_config(), T0_MS, set())
    assert refused is not None and refused.error.code == "reserved_request_id"

"""Validation against the model: prompt tokens (tokenizer.json or estimate), context, stops, deadlines."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from schemas.model_repo import ModelConfig
from services.gateway.guard.validation import TOKENS_PER_MESSAGE, TokenCounter, check_request, estimate_tokens
from services.gateway.openai_format import ApiError, parse_body, to_generate_request


@pytest.fixture(scope="module")
def word_model(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    """A model directory whose tokenizer.json splits on whitespace: one token per word."""
    path = tmp_path_factory.mktemp("wordmodel")
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(["hello", "world", "one", "two", "three"])}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    return ModelConfig(name="words", path=Path(path), max_model_len=32, default_timeout_s=30)


ECHO = ModelConfig(name="echo", engine="echo", max_model_len=64, default_timeout_s=120)


def request_of(kind: str, body: bytes, model: ModelConfig, timeout_s: float | None = None):
    parsed = parse_body(kind, body)
    request = to_generate_request(
        kind, parsed, model, request_id="r", reply_to="t", now_ms=1_000, client_timeout_s=timeout_s, max_timeout_s=600
    )
    return parsed, request


def test_counts_with_the_models_tokenizer(word_model: ModelConfig) -> None:
    counter = TokenCounter()
    assert counter.tokenizer(word_model) is not None
    assert counter.count(word_model, "hello world one") == 3
    body, _ = request_of(
        "chat.completions", b'{"model": "words", "messages": [{"role": "user", "content": "one two"}]}', word_model
    )
    assert counter.count_prompt(word_model, body) == 2 + TOKENS_PER_MESSAGE


def test_estimates_without_a_tokenizer() -> None:
    assert TokenCounter().tokenizer(ECHO) is None
    assert TokenCounter().count(ECHO, "x" * 40) == estimate_tokens("x" * 40) == 10
    assert estimate_tokens("a b c d e f") == 6  # never fewer than the words


def test_prompt_too_long_names_the_prompt(word_model: ModelConfig) -> None:
    prompt = " ".join(["hello"] * 40)
    body, request = request_of("completions", f'{{"model": "words", "prompt": "{prompt}"}}'.encode(), word_model)
    with pytest.raises(ApiError) as error:
        check_request(
            body,
            request,
            word_model,
            TokenCounter().count_prompt(word_model, body),
            max_input_tokens=None,
            max_stop_sequences=4,
        )
    assert (error.value.status, error.value.param, error.value.code) == (400, "prompt", "context_length_exceeded")
    with pytest.raises(ApiError) as capped:
        check_request(body, request, word_model, 10, max_input_tokens=5, max_stop_sequences=4)
    assert capped.value.param == "prompt"


def test_prompt_plus_max_tokens_must_fit_and_a_default_is_fitted(word_model: ModelConfig) -> None:
    explicit, request = request_of("completions", b'{"model": "words", "prompt": "x", "max_tokens": 30}', word_model)
    with pytest.raises(ApiError) as error:
        check_request(explicit, request, word_model, 10, max_input_tokens=None, max_stop_sequences=4)
    assert (error.value.param, error.value.code) == ("max_tokens", "context_length_exceeded")
    chat, request = request_of(
        "chat.completions",
        b'{"model": "words", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 30}',
        word_model,
    )
    with pytest.raises(ApiError) as chat_error:
        check_request(chat, request, word_model, 10, max_input_tokens=None, max_stop_sequences=4)
    assert chat_error.value.param == "max_completion_tokens"
    default, request = request_of("completions", b'{"model": "words", "prompt": "x"}', word_model)
    assert request.max_tokens == 16
    # the request keeps the default (the worker fits it to the room the prompt leaves, online and
    # in a batch alike); the charge counts only what fits: 20 prompt + 12
    assert check_request(default, request, word_model, 20, max_input_tokens=None, max_stop_sequences=4) == 32
    assert check_request(explicit, request, word_model, 5, max_input_tokens=None, max_stop_sequences=4) == 5 + 16


# What LiteLLM matches to raise ContextWindowExceededError, the error its context-window fallbacks act on
# (litellm_core_utils/exception_mapping_utils.py); other clients look for "maximum context length".
LITELLM_CONTEXT_WINDOW = "This model's maximum context length is"


def test_context_length_refusals_are_in_openais_words(word_model: ModelConfig) -> None:
    """Issue 35, item 5: OpenAI's and vLLM's sentence, with the numbers of the request."""
    chat = b'{"model": "words", "messages": [{"role": "user", "content": "x"}], "max_tokens": 20}'
    body, request = request_of("chat.completions", chat, word_model)
    with pytest.raises(ApiError) as both:  # prompt + max_tokens over the context
        check_request(body, request, word_model, 20, max_input_tokens=None, max_stop_sequences=4)
    assert both.value.message == (
        "This model's maximum context length is 32 tokens. However, you requested 40 tokens (20 in the messages, "
        "20 in the completion). Please reduce the length of the messages or completion."
    )
    with pytest.raises(ApiError) as prompt_too:  # the prompt alone, with an explicit max_tokens
        check_request(body, request, word_model, 5005, max_input_tokens=None, max_stop_sequences=4)
    assert prompt_too.value.message == (
        "This model's maximum context length is 32 tokens. However, you requested 5025 tokens (5005 in the "
        "messages, 20 in the completion). Please reduce the length of the messages or completion."
    )
    assert prompt_too.value.param == "messages"
    completion, request = request_of("completions", b'{"model": "words", "prompt": "x"}', word_model)
    with pytest.raises(ApiError) as alone:  # the prompt alone, max_tokens defaulted: no completion was asked
        check_request(completion, request, word_model, 5005, max_input_tokens=None, max_stop_sequences=4)
    assert alone.value.message == (
        "This model's maximum context length is 32 tokens. However, your prompt resulted in 5005 tokens, which "
        "leaves no room for the completion. Please reduce the length of the prompt."
    )
    with pytest.raises(ApiError) as capped:  # a deployment's WEIR_MAX_INPUT_TOKENS below the context
        check_request(completion, request, word_model, 10, max_input_tokens=5, max_stop_sequences=4)
    assert capped.value.message.startswith(
        "This model's maximum context length is 32 tokens, and this deployment "
        "accepts at most 5 tokens of prompt (WEIR_MAX_INPUT_TOKENS)."
    )
    with pytest.raises(ApiError) as huge:  # max_tokens past the context, refused before the prompt is counted
        request_of(
            "chat.completions",
            b'{"model": "words", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 40}',
            word_model,
        )
    assert huge.value.param == "max_completion_tokens"
    assert "you requested 40 tokens in the completion alone (max_completion_tokens)" in huge.value.message
    for error in (both, prompt_too, alone, capped, huge):
        assert error.value.message.startswith(LITELLM_CONTEXT_WINDOW) and error.value.code == "context_length_exceeded"


def test_too_many_stop_sequences_name_stop() -> None:
    body, request = request_of("completions", b'{"model": "echo", "prompt": "x", "stop": ["a", "b", "c"]}', ECHO)
    with pytest.raises(ApiError) as error:
        check_request(body, request, ECHO, 1, max_input_tokens=None, max_stop_sequences=2)
    assert (error.value.status, error.value.param) == (400, "stop")


def test_a_client_timeout_lowers_the_deadline_never_raises_it() -> None:
    body = b'{"model": "echo", "prompt": "x", "timeout_s": 5000}'
    _, request = request_of("completions", body, ECHO)
    assert request.deadline_ms - request.created_ms == 120_000  # the model's default wins
    _, request = request_of("completions", body, ECHO, timeout_s=2.5)
    assert request.deadline_ms - request.created_ms == 2_500


def test_out_of_range_top_k_is_400() -> None:
    with pytest.raises(ApiError) as error:
        parse_body("completions", b'{"model": "echo", "prompt": "x", "top_k": 100000000000000000000000}')
    assert error.value.param == "top_k"


def test_a_gguf_sourced_model_counts_with_its_import_once_it_exists(
    word_model: ModelConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry with a `source` and no `path` is served from $WEIR_HOME/models/<name>: estimated
    until the import is there, then counted with its tokenizer."""
    monkeypatch.setenv("WEIR_HOME", str(tmp_path))
    sourced = ModelConfig(name="words", source="llm-words", max_model_len=32, default_timeout_s=30)
    counter = TokenCounter()
    assert counter.tokenizer(sourced) is None
    assert counter.count(sourced, "hello world one two three") == estimate_tokens("hello world one two three")
    (tmp_path / "models" / "words").mkdir(parents=True)
    (tmp_path / "models" / "words" / "tokenizer.json").write_bytes((word_model.path / "tokenizer.json").read_bytes())
    assert counter.count(sourced, "hello world one two three") == 5

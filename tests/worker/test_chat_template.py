"""Chat templates: Weir renders what transformers' apply_chat_template renders, stops at the
template's end-of-turn token, and a template that refuses a chat ends only that request."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from schemas.messages import ChatMessage
from services.worker.engine import Engine, EngineConfig
from services.worker.engine.tokenizer import ModelTokenizer
from weir.chat_template import ChatTemplateError

from .factories import make_model_dir, make_request, write_tokenizer_config

transformers = pytest.importorskip("transformers")

TINY_DIR = Path(__file__).resolve().parents[2] / "models" / "weir-tiny-py"

# HuggingFaceTB/SmolLM2-135M-Instruct's template (ChatML with a default system turn), verbatim.
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou "
    "are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + "
    "message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# meta-llama/Meta-Llama-3-8B-Instruct's template, verbatim.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# mistralai/Mistral-7B-Instruct-v0.1's template: refuses any order but user/assistant/user/...
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == "
    "'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are "
    "supported!') }}{% endif %}{% endfor %}"
)
# What newer templates (Llama 3.1+, Qwen 2.5+) lean on: strftime_now, tojson (non-ASCII, HTML,
# indent), namespace, dict, loop controls, tools/documents (None), every named special token, and
# transformers' {% generation %} tag; whitespace control through trim_blocks/lstrip_blocks.
FEATURES = """{%- set ns = namespace(system='', count=0) %}
{%- for m in messages %}
    {%- if m['role'] == 'system' %}{% set ns.system = m['content'] %}{% continue %}{% endif %}
    {%- set ns.count = ns.count + 1 %}
    {%- if ns.count > 3 %}{% break %}{% endif %}
<|im_start|>{{ m['role'] }}
{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}{% else %}{{ m | tojson }}
{{ dict(n=ns.count, text=m['content']) | tojson(indent=2, sort_keys=true) }}{% endif %}<|im_end|>
{% endfor %}
{%- if ns.system %}[sys:{{ ns.system | trim }}]{% endif %}
tools={{ tools is none }} documents={{ documents is none }} date={{ strftime_now('%Y') }}
{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ pad_token }}|{{ undefined_variable }}|
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
LLAMA3_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
MISTRAL_TOKENS = ("<s>", "</s>")

CHATS = [
    [("user", "What is the capital of France?")],
    [("system", "  Be brief.  "), ("user", 'Hi <b>there</b> & "you"')],
    [("user", "def add(a, b):"), ("assistant", "  return a + b\n"), ("user", "Und auf Deutsch? Grüße, 東京 🚀")],
    [("system", "s"), ("user", "1"), ("assistant", "2"), ("user", "3"), ("assistant", "4"), ("user", "5")],
]


def tokenizer_dir(path: Path, template: str | None, special: tuple[str, ...], **config) -> Path:
    """weir-tiny-py's tokenizer.json plus `special` tokens, and a tokenizer_config.json."""
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(TINY_DIR / "tokenizer.json"))
    tok.add_special_tokens(list(special))
    tok.save(str(path / "tokenizer.json"))
    return write_tokenizer_config(path, template, **config)


def messages(chat: list[tuple[str, str]]) -> list[ChatMessage]:
    return [ChatMessage(role=role, content=content) for role, content in chat]


def hf_render(path: Path, chat: list[ChatMessage]) -> str:
    hf = transformers.AutoTokenizer.from_pretrained(path)
    turns = [m.model_dump() for m in chat]
    return hf.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)


TEMPLATES = {
    "smollm2-chatml": (SMOLLM2, CHATML_TOKENS, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}),
    "llama3": (LLAMA3, LLAMA3_TOKENS, {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}),
    "features": (
        FEATURES,
        CHATML_TOKENS,
        {
            "bos_token": "<|endoftext|>",
            "eos_token": "<|im_end|>",
            "unk_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
        },
    ),
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("chat", CHATS, ids=range(len(CHATS)))
def test_rendering_equals_transformers(name, chat, tmp_path):
    template, special, config = TEMPLATES[name]
    path = tokenizer_dir(tmp_path / name, template, special, **config)
    turns = messages(chat)
    weir = ModelTokenizer(path).render_chat(turns)
    assert weir == hf_render(path, turns)
    first_user = next(m for m in turns if m.role == "user")
    assert first_user.content.split()[0] in weir  # the chat is in the prompt, not an empty render


def test_mistral_template_renders_alternating_chats_and_refuses_others_as_transformers(tmp_path):
    path = tokenizer_dir(tmp_path, MISTRAL, MISTRAL_TOKENS, bos_token="<s>", eos_token="</s>")
    tok = ModelTokenizer(path)
    good = messages(CHATS[2])
    assert (
        tok.render_chat(good)
        == hf_render(path, good)
        == ("<s>[INST] def add(a, b): [/INST]  return a + b\n</s>[INST] Und auf Deutsch? Grüße, 東京 🚀 [/INST]")
    )
    bad = messages([("user", "a"), ("user", "b")])
    with pytest.raises(Exception, match="Conversation roles must alternate") as hf_error:
        hf_render(path, bad)
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        tok.render_chat(bad)
    assert "TemplateError" in type(hf_error.value).__name__


def test_chat_template_file_wins_and_specials_map_fills_in(tmp_path):
    """chat_template.jinja beats tokenizer_config.json, and special_tokens_map.json supplies tokens."""
    path = tokenizer_dir(tmp_path, "IGNORED", LLAMA3_TOKENS)
    (path / "chat_template.jinja").write_text(LLAMA3)
    (path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>"}))
    turns = messages(CHATS[1])
    weir = ModelTokenizer(path).render_chat(turns)
    assert weir == hf_render(path, turns)
    assert weir.startswith("<|begin_of_text|><|start_header_id|>system")


def test_sandbox_refuses_unsafe_template(tmp_path):
    path = tokenizer_dir(tmp_path, "{{ messages.__class__.__mro__ }}", ())
    with pytest.raises(ChatTemplateError, match="refused"):
        ModelTokenizer(path).render_chat(messages(CHATS[0]))
    bad_syntax = tokenizer_dir(tmp_path / "syntax", "{% for m in messages %}", ())
    with pytest.raises(ChatTemplateError, match=re.escape("tokenizer_config.json: chat template does not compile")):
        ModelTokenizer(bad_syntax)


@pytest.mark.parametrize(
    "template, special, config, end_of_turn",
    [
        (SMOLLM2, CHATML_TOKENS, {"eos_token": "<|endoftext|>"}, "<|im_end|>"),
        (LLAMA3, LLAMA3_TOKENS, {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, "<|eot_id|>"),
        (MISTRAL, MISTRAL_TOKENS, {"bos_token": "<s>", "eos_token": "</s>"}, "</s>"),
    ],
)
def test_end_of_turn_token_is_a_stop_token(template, special, config, end_of_turn, tmp_path):
    tok = ModelTokenizer(tokenizer_dir(tmp_path, template, special, **config))
    assert tok.end_of_turn == end_of_turn
    assert tok.token_id(end_of_turn) in tok.stop_token_ids
    assert tok.token_id(config["eos_token"]) in tok.stop_token_ids


def test_model_without_template_keeps_the_transcript_fallback():
    tok = ModelTokenizer(TINY_DIR)
    assert tok.end_of_turn is None
    assert tok.stop_token_ids == {0}
    chat = messages([("system", "Be brief."), ("user", "def main():")])
    assert tok.render_chat(chat) == "system: Be brief.\nuser: def main():\nassistant:"


@pytest.fixture(scope="module")
def chatml_model(tmp_path_factory) -> Path:
    path = make_model_dir(tmp_path_factory.mktemp("chatml") / "m", special_tokens=CHATML_TOKENS)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 7]}))  # 7: as Llama 3 lists more
    return write_tokenizer_config(path, SMOLLM2, eos_token="<|endoftext|>")


def chat_request(chat: list[tuple[str, str]], **overrides):
    return make_request(**{"prompt": None, "messages": messages(chat), **overrides})


def run(engine: Engine) -> list:
    events = []
    while engine.has_work:
        events.extend(engine.step(0))
    return events


def test_generation_stops_at_end_of_turn_token(chatml_model):
    engine = Engine(chatml_model, EngineConfig(max_model_len=128, kv_cache_bytes=4 << 20))
    im_end = engine.tokenizer.token_id("<|im_end|>")
    assert engine.eos_ids == {0, 7, im_end}  # config.json, generation_config.json, the template's end of turn
    # a head that always answers <|im_end|>: the first token ends the turn, and is not text
    head = torch.nn.Linear(engine.model.args.hidden_size, engine.model.args.vocab_size)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[im_end] = 1.0
    engine.model.lm_head = head
    stops = run_add(engine, chat_request([("user", "def add(a, b):")], max_tokens=5))
    assert stops[-1].finish_reason == "stop" and stops[-1].completion_tokens == 0
    runs_on = run_add(engine, chat_request([("user", "def add(a, b):")], max_tokens=5, ignore_eos=True))
    assert runs_on[-1].finish_reason == "length" and runs_on[-1].completion_tokens == 5


def run_add(engine: Engine, request) -> list:
    assert engine.add(request, 0) is None
    return [e for e in run(engine) if e.request_id == request.request_id]


def test_template_refusal_ends_only_that_request(chatml_model, tmp_path):
    path = tmp_path / "mistral"
    shutil.copytree(chatml_model, path)
    write_tokenizer_config(path, MISTRAL, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    engine = Engine(path, EngineConfig(max_model_len=128, kv_cache_bytes=4 << 20))
    refused = engine.add(chat_request([("system", "s"), ("user", "u")]), 0)
    assert refused.finish_reason == "rejected" and refused.error.code == "chat_template_error"
    assert "Conversation roles must alternate" in refused.error.message
    served = run_add(engine, chat_request([("user", "def add(a, b):")], max_tokens=3, ignore_eos=True))
    assert served[-1].finish_reason == "length" and served[-1].prompt_tokens > 0

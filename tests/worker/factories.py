"""Factories for worker tests: tiny random Hugging Face model directories, requests, model entries
and engine outputs."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from schemas.messages import EmbedRequest, GenerateRequest, now_ms
from schemas.model_repo import ModelConfig
from services.worker.engine import EngineOutput

T0_MS = 1_700_000_000_000  # a fixed "now" in epoch ms, for the pure cores

_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nimport sys\nprint(os.path.join('a', 'b'))\n",
    "for i in range(10):\n    if i % 2 == 0:\n        continue\n",
] * 20
_ids = itertools.count()


def make_tokenizer(path: Path, vocab_size: int = 300, special_tokens: tuple[str, ...] = ()) -> Tokenizer:
    """A byte-level BPE tokenizer saved as path/tokenizer.json, with <|endoftext|> as id 0 and
    `special_tokens` added after the vocabulary."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_TEXT, trainer)
    tok.add_special_tokens(list(special_tokens))
    tok.save(str(path / "tokenizer.json"))
    return tok


def make_model_dir(
    path: Path,
    arch: str = "llama",
    seed: int = 0,
    num_kv_heads: int = 2,
    special_tokens: tuple[str, ...] = (),
    **config_overrides,
) -> Path:
    """A random-weight Llama or Qwen2 directory (config.json, model.safetensors, tokenizer.json).

    config_overrides replace LlamaConfig/Qwen2Config arguments (rope_scaling, max_position_embeddings...).
    """
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(path, special_tokens=special_tokens)
    torch.manual_seed(seed)
    common = dict(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=0,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    )
    common.update(config_overrides)
    if arch == "llama":
        config = transformers.LlamaConfig(**common, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    return path


def write_tokenizer_config(path: Path, chat_template: str | None = None, **special_tokens: str) -> Path:
    """path/tokenizer_config.json for a fast tokenizer, with a chat template and named special tokens."""
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    config.update(special_tokens)
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return path


def make_request(prompt: str = "def ", **overrides) -> GenerateRequest:
    """A GenerateRequest with sane defaults; overrides replace any field."""
    fields = dict(
        request_id=f"req-{next(_ids)}",
        model="tiny",
        prompt=prompt,
        max_tokens=8,
        temperature=0.0,
        deadline_ms=now_ms() + 60_000,
        reply_to="weir.replies.test",
    )
    fields.update(overrides)
    return GenerateRequest(**fields)


def make_embed_request(*inputs: str, **overrides) -> EmbedRequest:
    """An EmbedRequest for the model "minilm"; overrides replace any field."""
    fields = dict(
        request_id=f"emb-{next(_ids)}",
        model="minilm",
        inputs=list(inputs) or ["hello"],
        deadline_ms=T0_MS + 60_000,
        reply_to="weir.replies.test",
        created_ms=T0_MS,
    )
    fields.update(overrides)
    return EmbedRequest(**fields)


def make_model_config(name: str = "tiny", **overrides) -> ModelConfig:
    """A model repository entry (engine torch unless overridden)."""
    fields: dict = dict(name=name, path=f"/models/{name}")
    fields.update(overrides)
    return ModelConfig(**fields)


def make_output(request_id: str, seq: int = 0, **overrides) -> EngineOutput:
    """An engine output of `request_id`; give finish_reason to make it final."""
    return EngineOutput(request_id, seq, **overrides)

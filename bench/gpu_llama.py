"""GPU benchmark of Weir's engine on a 1B-class Llama with random weights, in bf16.

Run on a CUDA machine: `python -m bench gpu-llama [--out DIR]` (scripts/gpu_check.sh runs it). Reports:
  - decode tokens/s at batch 1 against the memory-bandwidth bound (every step reads all weights
    and the KV cache once, so bound = bandwidth / bytes read per token), as a fraction;
  - throughput at batch 64 against transformers' generate() on a static batch of the same 64.
Writes a JSON and a Markdown table to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

from schemas.messages import GenerateRequest, now_ms
from services.worker.engine import Engine, EngineConfig

# H200 HBM3e: 4.8 TB/s peak (NVIDIA datasheet); override with --bandwidth-gbs for other parts.
DEFAULT_BANDWIDTH_GBS = 4800.0


def build_model(path: Path) -> None:
    """A Llama-3.2-1B-shaped model with random weights, saved in bf16 with a byte tokenizer."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # rope_theta and torch_dtype: names every supported transformers takes (5.x maps them; its stubs do not)
    config = transformers.LlamaConfig(  # type: ignore[call-arg]  # transformers' stubs lag its config keywords
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]  # transformers' decorated .to() confuses mypy
    model.save_pretrained(path, safe_serialization=True)
    vocab = {f"<{i}>": i for i in range(32000)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    tok.save(str(path / "tokenizer.json"))


def request(prompt_ids: list[int], max_tokens: int) -> GenerateRequest:
    return GenerateRequest(
        request_id=uuid.uuid4().hex,
        model="llama-1b",
        prompt="x",
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        deadline_ms=now_ms() + 3_600_000,
        reply_to="-",
    )


def engine_run(engine: Engine, batch: int, prompt_len: int, max_tokens: int) -> tuple[float, float]:
    """(decode tokens/s, wall s) for `batch` requests started together."""
    g = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        ids = torch.randint(3, 32000, (prompt_len,), generator=g).tolist()
        engine.add_tokens(request(ids, max_tokens), ids, now_ms())
    engine.step(now_ms())  # prefill
    torch.cuda.synchronize()
    start, tokens = time.perf_counter(), 0
    while engine.has_work:
        tokens += sum(len(o.token_ids) for o in engine.step(now_ms()))
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return tokens / wall, wall


def hf_static(path: Path, batch: int, prompt_len: int, max_tokens: int) -> float:
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    hf = loaded.cuda().eval()  # type: ignore[call-arg]  # transformers' decorated .cuda() confuses mypy
    ids = torch.randint(3, 32000, (batch, prompt_len), device="cuda")
    hf.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    hf.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    return batch * max_tokens / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weir bench gpu-llama", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("/tmp/weir-gpu-check"))
    parser.add_argument("--bandwidth-gbs", type=float, default=DEFAULT_BANDWIDTH_GBS)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp()) / "llama-1b"
    build_model(path)
    engine = Engine(
        path, EngineConfig(max_model_len=1024, max_num_seqs=128, max_num_batched_tokens=8192), torch.device("cuda")
    )
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    engine_run(engine, 1, args.prompt_len, 8)  # warm up kernels
    tps1, _ = engine_run(engine, 1, args.prompt_len, args.max_tokens)
    mean_ctx = args.prompt_len + args.max_tokens / 2
    bytes_per_token = weight_bytes + mean_ctx * engine.kv_bytes_per_token
    bound = args.bandwidth_gbs * 1e9 / bytes_per_token
    tps64, _ = engine_run(engine, 64, args.prompt_len, args.max_tokens)
    del engine
    torch.cuda.empty_cache()
    hf64 = hf_static(path, 64, args.prompt_len, args.max_tokens)
    result = {
        "device": torch.cuda.get_device_name(),
        "params_b": weight_bytes / 2 / 1e9,
        "weight_bytes": weight_bytes,
        "batch1_tokens_per_s": tps1,
        "batch1_bandwidth_bound_tokens_per_s": bound,
        "batch1_fraction_of_bound": tps1 / bound,
        "batch64_tokens_per_s": tps64,
        "hf_generate_batch64_tokens_per_s": hf64,
        "batch64_ratio_vs_hf": tps64 / hf64,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "torch": torch.__version__,
    }
    (args.out / "gpu_bench_llama.json").write_text(json.dumps(result, indent=2))
    table = "\n".join(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in result.items())
    (args.out / "gpu_bench_llama.md").write_text("| metric | value |\n|---|---|\n" + table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

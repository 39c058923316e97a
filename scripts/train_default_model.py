#!/usr/bin/env python3
r"""Train Weir's default model, ``weir-tiny-py``, from nothing but the Python standard library.

The corpus is the ``*.py`` source of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``), which is present on every machine that can run Weir, so the
model can be regenerated anywhere without a download. Test directories, ``site-packages``, the
codec tables under ``encodings/`` and the generated ``pydoc_data/`` are left out; files are read in
sorted order so that, for a given Python version, the corpus and everything after it are
deterministic.

Two stages:

1. A byte-level BPE tokenizer (``tokenizers``): ByteLevel pre-tokenizer and decoder over the full
   256-byte alphabet, so ``decode(encode(x), skip_special_tokens=False) == x`` for any text,
   whitespace and indentation included. Before the byte mapping, text is split into identifier
   runs, punctuation runs and whitespace runs, one trailing space staying with the word or
   punctuation before it (``"def "``, ``"return "``, ``", "``) and indentation staying whole
   (``"\n    "``). GPT-2's split does the opposite (``"def" + " foo"``, ``"\n   " + " return"``),
   which leaves prompts that end in a space or in indentation, the usual way to prompt for code,
   on a token boundary the model never saw in training. ``<|endoftext|>`` is the only special
   token and serves as bos, eos and pad. The tokenizer adds no special tokens on its own (as
   GPT-2's does not); training documents are separated by ``<|endoftext|>``.
2. A small Llama-architecture causal LM in plain PyTorch whose parameter names, RoPE convention
   (``rotate_half``), RMSNorm and gated SiLU MLP are exactly those of Hugging Face's
   ``LlamaForCausalLM``, trained with AdamW (linear warmup, cosine decay) on random windows of the
   token stream. Files are split into train and validation by position in the sorted list.

The output directory is a Hugging Face-format model directory: ``config.json``,
``generation_config.json``, ``model.safetensors`` (float16 by default, tied embeddings, so no
``lm_head.weight``), ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``,
plus ``TRAINING.json`` (settings, losses, timings) and a ``README.md`` model card.

Regenerate the committed model with the defaults:

    python scripts/train_default_model.py            # writes models/weir-tiny-py/

Every size and schedule setting is a flag (``--help``); the defaults are the ones that made the
committed model. ``--bench N`` times N training steps and exits without writing anything.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

EOS = "<|endoftext|>"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "models" / "weir-tiny-py"

# Directory names skipped anywhere under the stdlib, and top-level packages skipped entirely.
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
SKIP_TOP = {"encodings", "pydoc_data"}


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------


def stdlib_files(root: Path) -> list[Path]:
    """The standard library's *.py files, test dirs and site-packages excluded, sorted."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        dirnames[:] = sorted(
            d
            for d in dirnames
            if d not in SKIP_DIRS and not d.startswith("test") and not (rel == Path(".") and d in SKIP_TOP)
        )
        for name in filenames:
            if name.endswith(".py") and not name.startswith("test_"):
                found.append(Path(dirpath) / name)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def read_corpus(root: Path) -> tuple[list[str], list[str]]:
    """(relative names, texts) of every stdlib file that is valid UTF-8 and not empty."""
    names: list[str] = []
    texts: list[str] = []
    for path in stdlib_files(root):
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not text.strip():
            continue
        names.append(path.relative_to(root).as_posix())
        texts.append(text)
    return names, texts


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


# Identifier runs, punctuation runs (each keeping one trailing space) and whitespace runs. Every
# character matches one branch, so the split loses nothing.
SPLIT_PATTERN = r"[\p{L}\p{N}_]+ ?|[^\s\p{L}\p{N}_]+ ?|\s+"


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer with `<|endoftext|>` as id 0."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


# --------------------------------------------------------------------------------------------
# Model: Llama in plain torch, Hugging Face LlamaForCausalLM parameter names and conventions
# --------------------------------------------------------------------------------------------


@dataclass
class LlamaArgs:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 1024
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(args: LlamaArgs, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (T, head_dim) in HF's convention (frequencies repeated, not interleaved)."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv = args.num_key_value_heads
        self.head_dim = args.head_dim
        h = args.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        cos = cos.to(q.dtype)
        sin = sin.to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.n_kv != self.n_heads:
            rep = self.n_heads // self.n_kv
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """state_dict() keys match transformers' LlamaForCausalLM (lm_head absent when tied)."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.model = LlamaBody(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.args.initializer_range
        # Residual-branch output projections get GPT-2's 1/sqrt(2 * layers) scaling.
        out_std = std / math.sqrt(2 * self.args.num_hidden_layers)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, 0.0, out_std)
            else:
                nn.init.normal_(p, 0.0, std)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        cos, sin = rope_cos_sin(self.args, torch.arange(t, device=input_ids.device))
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        sd = dict(self.state_dict())
        if self.args.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        return sd

    @torch.no_grad()
    def generate(
        self,
        ids: list[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        eos_id: int | None = None,
        gen: torch.Generator | None = None,
    ) -> list[int]:
        out = list(ids)
        for _ in range(max_new_tokens):
            ctx = torch.tensor([out[-self.args.max_position_embeddings :]])
            logits = self(ctx)[0, -1].float()
            if temperature <= 0:
                nxt = int(logits.argmax())
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, top_k).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            out.append(nxt)
            if eos_id is not None and nxt == eos_id:
                break
        return out


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    floor = args.lr * args.min_lr_ratio
    return floor + 0.5 * (args.lr - floor) * (1 + math.cos(math.pi * min(1.0, progress)))


def make_batch(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(seq + 1)[None, :]
    chunk = data[idx]
    return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, data: torch.Tensor, args: argparse.Namespace) -> float:
    """Mean loss over fixed, non-overlapping windows (the same every call)."""
    model.eval()
    seq = args.seq_len
    n_windows = min(args.eval_windows, (data.numel() - 1) // seq)
    stride = ((data.numel() - 1) // seq) // n_windows * seq
    starts = torch.arange(n_windows) * stride
    losses = []
    for i in range(0, n_windows, args.batch_size):
        s = starts[i : i + args.batch_size]
        idx = s[:, None] + torch.arange(seq + 1)[None, :]
        chunk = data[idx]
        with autocast(args):
            logits = model(chunk[:, :-1])
        losses.append(
            F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum"
            ).item()
        )
    model.train()
    return sum(losses) / (n_windows * seq)


def autocast(args: argparse.Namespace):
    if args.autocast == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output model directory")
    p.add_argument(
        "--stdlib",
        type=Path,
        default=Path(sysconfig.get_paths()["stdlib"]),
        help="standard library directory used as the corpus",
    )
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=688)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--max-position-embeddings", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=256, help="training context length")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr as a fraction of peak")
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--val-every", type=int, default=25, help="every Nth corpus file goes to the validation split")
    p.add_argument("--eval-interval", type=int, default=200)
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--autocast",
        choices=["none", "bf16"],
        default="bf16",
        help="CPU autocast for matmuls during training (master weights stay fp32)",
    )
    p.add_argument("--save-dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    p.add_argument("--bench", type=int, default=0, help="time this many steps, write nothing, exit")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t_start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    # ---- corpus and tokenizer
    _names, texts = read_corpus(args.stdlib)
    val_idx = set(range(args.val_every // 2, len(texts), args.val_every)) if args.val_every > 0 else set()
    train_texts = [t for i, t in enumerate(texts) if i not in val_idx]
    val_texts = [t for i, t in enumerate(texts) if i in val_idx]
    n_bytes = sum(len(t.encode()) for t in texts)
    log(
        f"corpus: {len(texts)} files, {n_bytes / 1e6:.2f} MB from {args.stdlib} "
        f"({len(train_texts)} train / {len(val_texts)} val files)"
    )

    tok = train_tokenizer(train_texts, args.vocab_size)
    eos_id = tok.token_to_id(EOS)
    vocab = tok.get_vocab_size()
    log(f"tokenizer: vocab {vocab}, {EOS} = {eos_id}, trained in {time.time() - t_start:.1f}s")

    def encode_stream(ts: list[str]) -> torch.Tensor:
        ids: list[int] = []
        for enc in tok.encode_batch(ts, add_special_tokens=False):
            ids.append(eos_id)
            ids.extend(enc.ids)
        ids.append(eos_id)
        return torch.tensor(ids, dtype=torch.long)

    train_data = encode_stream(train_texts)
    val_data = encode_stream(val_texts)
    log(
        f"tokens: {train_data.numel():,} train, {val_data.numel():,} val "
        f"({n_bytes / (train_data.numel() + val_data.numel()):.2f} bytes/token)"
    )

    # ---- model
    margs = LlamaArgs(
        vocab_size=vocab,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_position_embeddings,
    )
    assert args.hidden_size % args.heads == 0 and args.heads % args.kv_heads == 0
    assert args.seq_len <= args.max_position_embeddings
    model = LlamaForCausalLM(margs)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params:,} parameters ({asdict(margs)})")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(args.seed)
    steps = args.bench or args.steps

    history: list[dict] = []
    t_train = time.time()
    ema = None
    model.train()
    for step in range(steps):
        lr = lr_at(step, args)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = make_batch(train_data, args.batch_size, args.seq_len, gen)
        with autocast(args):
            logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        lv = loss.item()
        ema = lv if ema is None else 0.9 * ema + 0.1 * lv
        if step % args.log_interval == 0 or step == steps - 1:
            el = time.time() - t_train
            tps = (step + 1) * args.batch_size * args.seq_len / el
            log(
                f"step {step:5d}/{steps} loss {lv:.4f} (ema {ema:.4f}) lr {lr:.2e} "
                f"gnorm {float(gnorm):.2f} {tps:,.0f} tok/s"
            )
        if not args.bench and ((step + 1) % args.eval_interval == 0 or step == steps - 1):
            vl = evaluate(model, val_data, args)
            history.append(
                {
                    "step": step + 1,
                    "train_loss_ema": round(ema, 4),
                    "val_loss": round(vl, 4),
                    "elapsed_s": round(time.time() - t_train, 1),
                }
            )
            log(f"eval step {step + 1}: val loss {vl:.4f} (ppl {math.exp(vl):.2f})")
    train_s = time.time() - t_train
    if args.bench:
        log(f"bench: {steps} steps in {train_s:.1f}s = {train_s / steps:.2f} s/step")
        return 0

    final_val = history[-1]["val_loss"]
    final_train = evaluate(model, train_data, args)
    log(f"final: train loss {final_train:.4f}, val loss {final_val:.4f}, training took {train_s:.0f}s")

    # ---- samples from the in-script model (fp32) for the model card
    model.eval()
    samples = {}
    for prompt in ("def ", "import os\n", "class Foo:"):
        ids = tok.encode(prompt, add_special_tokens=False).ids
        out = model.generate(ids, 48, temperature=0.0, eos_id=eos_id)
        samples[prompt] = tok.decode(out, skip_special_tokens=False)
        log(f"greedy sample {prompt!r}:\n{samples[prompt]}\n---")

    # ---- save
    save(
        args,
        model,
        margs,
        tok,
        eos_id,
        {
            "corpus": {
                "stdlib": str(args.stdlib),
                "python": platform.python_version(),
                "files": len(texts),
                "train_files": len(train_texts),
                "val_files": len(val_texts),
                "bytes": n_bytes,
                "train_tokens": train_data.numel(),
                "val_tokens": val_data.numel(),
            },
            "parameters": n_params,
            "train_loss": round(final_train, 4),
            "val_loss": final_val,
            "final_train_loss_ema": round(ema, 4),
            "train_seconds": round(train_s, 1),
            "total_seconds": round(time.time() - t_start, 1),
            "tokens_seen": steps * args.batch_size * args.seq_len,
            "history": history,
            "greedy_samples": samples,
            "settings": {
                k: (str(v) if isinstance(v, Path) else v)
                for k, v in vars(args).items()
                if k not in ("out", "stdlib", "bench")
            },
            "versions": {
                "torch": torch.__version__,
                "tokenizers": __import__("tokenizers").__version__,
                "python": sys.version.split()[0],
            },
        },
    )
    log(f"wrote {args.out}")
    return 0


def save(args, model: LlamaForCausalLM, margs: LlamaArgs, tok, eos_id: int, report: dict) -> None:
    from safetensors.torch import save_file

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, args.save_dtype)
    sd = {k: v.detach().to(dtype).contiguous() for k, v in model.hf_state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": margs.vocab_size,
        "hidden_size": margs.hidden_size,
        "intermediate_size": margs.intermediate_size,
        "num_hidden_layers": margs.num_hidden_layers,
        "num_attention_heads": margs.num_attention_heads,
        "num_key_value_heads": margs.num_key_value_heads,
        "head_dim": margs.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": margs.max_position_embeddings,
        "initializer_range": margs.initializer_range,
        "rms_norm_eps": margs.rms_norm_eps,
        "rope_theta": margs.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": margs.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": margs.tie_word_embeddings,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "use_cache": True,
        "torch_dtype": args.save_dtype,
        "dtype": args.save_dtype,
    }
    write_json(out / "config.json", config)
    write_json(
        out / "generation_config.json",
        {
            "bos_token_id": eos_id,
            "eos_token_id": eos_id,
            "pad_token_id": eos_id,
            "do_sample": False,
        },
    )

    tok.save(str(out / "tokenizer.json"))
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": EOS,
            "eos_token": EOS,
            "unk_token": EOS,
            "pad_token": EOS,
            "add_bos_token": False,
            "add_eos_token": False,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": margs.max_position_embeddings,
            "added_tokens_decoder": {
                str(eos_id): {
                    "content": EOS,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                }
            },
        },
    )
    write_json(
        out / "special_tokens_map.json", {"bos_token": EOS, "eos_token": EOS, "unk_token": EOS, "pad_token": EOS}
    )
    write_json(out / "TRAINING.json", report)
    (out / "README.md").write_text(model_card(args, margs, report, out))


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def model_card(args, margs: LlamaArgs, r: dict, out: Path) -> str:
    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file() and p.name != "README.md"}
    c = r["corpus"]
    s = args
    hist = "\n".join(
        f"| {h['step']} | {h['train_loss_ema']:.3f} | {h['val_loss']:.3f} | {h['elapsed_s']:.0f} |"
        for h in r["history"]
    )
    samples = "\n\n".join(f"Prompt `{p!r}`:\n\n```python\n{t}\n```" for p, t in r["greedy_samples"].items())
    files = "\n".join(f"| `{n}` | {b:,} |" for n, b in sizes.items())
    return f"""# weir-tiny-py

Weir's default model: a {r["parameters"] / 1e6:.1f}M-parameter Llama-architecture causal language model
and its byte-level BPE tokenizer, both trained from scratch by
[`scripts/train_default_model.py`](../../scripts/train_default_model.py) on the source code of the
Python standard library. It writes Python-looking text (indentation, `def`, `self.`, `return`,
docstrings) and nothing more useful than that: it exists so that Weir's pipeline, worker and tests
have a real model to load that needs no download, not to be a good code model.

The directory is in Hugging Face format and loads with
`transformers.LlamaForCausalLM.from_pretrained` and `PreTrainedTokenizerFast`/`AutoTokenizer`.

## Architecture

| setting | value |
|---|---|
| architecture | `LlamaForCausalLM` (model_type `llama`) |
| parameters | {r["parameters"]:,} (tied input/output embeddings; no `lm_head.weight` stored) |
| hidden size | {margs.hidden_size} |
| layers | {margs.num_hidden_layers} |
| attention heads / key-value heads | {margs.num_attention_heads} / {margs.num_key_value_heads} (GQA), head dim {margs.head_dim} |
| MLP | gated SiLU, intermediate size {margs.intermediate_size} |
| norm | RMSNorm, eps {margs.rms_norm_eps} |
| position | RoPE, theta {margs.rope_theta:g} (HF `rotate_half` convention), max positions {margs.max_position_embeddings} |
| vocabulary | {margs.vocab_size} byte-level BPE tokens |
| special token | `<|endoftext|>` = id 0, used as bos, eos and pad |
| weights | `{s.save_dtype}` safetensors |

Before byte-level BPE, text is split into identifier runs, punctuation runs and whitespace runs,
with one trailing space kept on the word or punctuation before it (`"def "`, `"return "`, `", "`)
and indentation kept whole (`"\\n    "`), so prompts that end in a space or in indentation sit on
a token boundary seen in training. The tokenizer adds no special tokens by itself, and
`decode(encode(x), skip_special_tokens=False) == x` for any text, whitespace and indentation
included (a literal `<|endoftext|>` in the text becomes the special token and decodes back).
Training documents are single files separated by `<|endoftext|>`, so a prompt may start with it
to mean "start of a file".

## Data

The `*.py` files of the standard library of Python {c["python"]} (`sysconfig.get_paths()["stdlib"]`),
in sorted order, leaving out `site-packages`, every `test*`/`idle_test` directory, `test_*.py`,
the codec tables in `encodings/` and the generated `pydoc_data/`: {c["files"]} files,
{c["bytes"] / 1e6:.1f} MB, {c["train_tokens"] + c["val_tokens"]:,} tokens. Every {s.val_every}th
file ({c["val_files"]} files, {c["val_tokens"]:,} tokens) is held out for validation; the tokenizer
and the model see only the other {c["train_files"]}.

## Training

AdamW (betas 0.9/0.95, weight decay {s.weight_decay} on matrices), peak learning rate {s.lr:g}
with {s.warmup} warmup steps and cosine decay to {s.min_lr_ratio:g}x, gradient clipping
{s.grad_clip}, {s.steps} steps of {s.batch_size} random windows of {s.seq_len} tokens
({r["tokens_seen"]:,} tokens, about {r["tokens_seen"] / c["train_tokens"]:.1f} epochs),
{"bf16 autocast with fp32 master weights" if s.autocast == "bf16" else "fp32"}, seed {s.seed}, on
{s.threads} CPU threads: {r["train_seconds"] / 60:.1f} minutes of training
({r["train_seconds"] / s.steps:.2f} s/step), {r["total_seconds"] / 60:.1f} minutes in all. Wall time
depends mostly on how busy the machine is: on two otherwise idle cores a step takes about 0.7 s,
so the defaults take 12-20 minutes.

| step | train loss (EMA) | val loss | seconds |
|---|---|---|---|
{hist}

Final loss (nats/token, fp32 model): train **{r["train_loss"]:.3f}**, validation **{r["val_loss"]:.3f}**
(see `TRAINING.json`).

## Greedy samples (48 new tokens)

{samples}

## Files

| file | bytes |
|---|---|
{files}

## Regenerate

```sh
python scripts/train_default_model.py            # defaults are the settings above
python scripts/train_default_model.py --help     # sizes, steps, schedule, output directory
```

The result is deterministic for a given Python version (which fixes the corpus), torch version
and CPU; another Python version gives a similar but not identical model.
"""


if __name__ == "__main__":
    raise SystemExit(main())

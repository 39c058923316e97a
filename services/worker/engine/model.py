"""Llama- and Qwen2-style causal LMs over a paged KV cache, loaded from Hugging Face directories.

The forward pass takes a flat list of tokens from many sequences at once (prefill chunks and
decode tokens mixed), writes their K/V into cache slots, and attends each token over its own
sequence's context through the block tables. Parameter names follow Hugging Face's, so any
LlamaForCausalLM / Qwen2ForCausalLM safetensors directory loads; q/k/v and gate/up are fused at
load time into one matmul each.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from kernels import apply_rotary, paged_attention_decode, rms_norm, silu_and_mul
from kernels.dispatch import use_triton
from kernels.paged_attention import DecodePlan, decode_plan
from kernels.rotary import rotary_rows, rotate_half_rows
from services.worker.engine.rope import RopeConfigError, RopeScaling, RotaryEmbedding
from weir.digests import cached_sha256

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"}


class ModelLoadError(RuntimeError):
    """The model directory cannot be served; the message says which file or key and why."""


@dataclass(frozen=True)
class ModelArgs:
    """The subset of a Hugging Face config.json that the architecture needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    has_qkv_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @staticmethod
    def from_hf_config(config: dict, generation_config: dict | None = None) -> ModelArgs:
        """Read a config.json dict; raises ModelLoadError naming the missing or unsupported key.

        End-of-sequence ids are config.json's and generation_config.json's together (a chat model
        lists its end-of-turn token there, e.g. Llama 3's <|eot_id|>).
        """
        archs = config.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"architectures={archs} unsupported; expected one of {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            eos_ids = _token_ids(config.get("eos_token_id")) + _token_ids((generation_config or {}).get("eos_token_id"))
            rope = RopeScaling.from_hf_config(config)
            return ModelArgs(
                architecture=arch,
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope=rope,
                max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                has_qkv_bias=arch == "Qwen2ForCausalLM" or bool(config.get("attention_bias", False)),
                eos_token_ids=tuple(dict.fromkeys(eos_ids)),
                bos_token_id=config.get("bos_token_id"),
            )
        except KeyError as exc:
            raise ModelLoadError(f"config.json lacks {exc.args[0]!r}") from exc
        except RopeConfigError as exc:
            raise ModelLoadError(f"config.json: {exc}") from exc

    @property
    def max_context_len(self) -> int:
        """Most positions a sequence may take (RoPE scaling may stretch max_position_embeddings)."""
        return self.rope.max_context_len


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """An eos_token_id entry (an int, a list of ints or null) as a tuple."""
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


@dataclass
class AttentionMetadata:
    """Where each token of a step lives in the KV cache and what it attends to.

    Tokens are laid out as [prefill chunks..., decode tokens...].
    """

    slot_mapping: torch.Tensor  # [tokens] int64: block_id * block_size + offset
    # prefill: one entry per sequence chunk: (token_start, token_end, block_table [n] int64, ctx_len)
    prefills: list[tuple[int, int, torch.Tensor, int]] = field(default_factory=list)
    num_decode_tokens: int = 0
    # decodes in groups attended by one call each: (first decode row, end row, block_tables
    # [rows, max_blocks] int32, context_lens [rows] int32); rows count from the first decode token
    decode_groups: list[tuple[int, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # rows of the output to compute logits for (last token of each sequence that samples)
    logits_indices: torch.Tensor | None = None
    # [tokens] int64: the sequence length each token's rotation is for; set only when the
    # model's RoPE depends on it (dynamic NTK past max_position_embeddings), see engine/rope.py
    rope_seq_lens: torch.Tensor | None = None
    # made by the model's forward on the CPU, once per step for every layer: the (cos, sin) rows
    # of the step's tokens (kernels.rotary.rotary_rows) and each decode group's DecodePlan
    rotary_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    decode_plans: list[DecodePlan] | None = None


def cpu_packed_gemm_available() -> bool:
    """Whether float32 CPU matmuls can run on prepacked oneDNN weights (WEIR_CPU_PACKED_GEMM=0: never).

    On this repository's AMD EPYC development box, with one thread, torch's default float32 linear
    (MKL sgemm) makes 16-40 GMAC/s at 32-512 rows; oneDNN on a weight reordered once into its
    blocked layout makes 70-100 (docs/benchmarks.md, "What was tried"). The packed copy is held
    beside the parameter, so CPU weights take twice their size (services/worker/hosts/memory.py).
    """
    if os.environ.get("WEIR_CPU_PACKED_GEMM", "1") == "0":
        return False
    mkldnn = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
    )


class Linear(nn.Linear):
    """nn.Linear whose CPU float32 matmul runs on a oneDNN copy of the weight once pack() made one.

    The parameter stays the source of truth (loading, tying, faults.py's noise): pack() again
    after changing it.
    """

    packed: torch.Tensor | None = None

    def pack(self) -> None:
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


QUANTIZATIONS = ("none", "int8", "int4")


class QuantLinear(nn.Module):
    """A projection whose weight stays quantized per 32-value block along K (kernels/cpu_quant.py).

    int8: q int8 [N, K] and f16 scales [N, K/32] (ggml's Q8_0); int4: q uint8 [N, K/2], f16 scales and
    mins [N, K/32] (ggml's Q4_1). The buffers slice by output rows, and by input columns at multiples of
    32, so a tensor-parallel split keeps the layout. On the CPU the AVX2 kernels run it (activations
    quantized per row to int8, as llama.cpp); elsewhere, and without the extension, each call
    dequantizes (correct, not fast).
    """

    # buffers (registered in __init__; assigning a tensor to one replaces the buffer)
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None  # int4 only

    def __init__(self, in_features: int, out_features: int, bias: bool, quantization: str) -> None:
        super().__init__()
        if quantization not in ("int8", "int4"):
            raise ValueError(f"quantization {quantization!r} is not int8 or int4")
        self.in_features, self.out_features, self.quantization = in_features, out_features, quantization
        # K is padded with zero columns to whole blocks (the activations too, per call); none of
        # SmolLM2's or Llama's dimensions need it, weir-tiny-py's 688 does
        self.padded_in = -(-in_features // 32) * 32
        cols = self.padded_in if quantization == "int8" else self.padded_in // 2
        self.register_buffer(
            "qweight", torch.empty(out_features, cols, dtype=torch.int8 if quantization == "int8" else torch.uint8)
        )
        self.register_buffer("scales", torch.empty(out_features, self.padded_in // 32, dtype=torch.float16))
        self.register_buffer(
            "mins",
            torch.empty(out_features, self.padded_in // 32, dtype=torch.float16) if quantization == "int4" else None,
        )
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def load(self, weight: torch.Tensor) -> None:
        """Quantize a float [N, K] weight into this module's buffers."""
        from kernels import cpu_quant

        weight = F.pad(weight, (0, self.padded_in - self.in_features))
        if self.quantization == "int8":
            q, d = cpu_quant.quantize_int8(weight)
        else:
            q, d, m = cpu_quant.quantize_int4(weight)
            self.mins = m.to(self.scales.device)
        self.qweight, self.scales = q.to(self.qweight.device), d.to(self.scales.device)

    def share(self, other: QuantEmbedding) -> None:
        """Read the same quantized tensors as a tied embedding."""
        self.qweight, self.scales, self.mins = other.qweight, other.scales, other.mins

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from kernels import cpu_quant

        if self.padded_in != self.in_features:
            x = F.pad(x, (0, self.padded_in - self.in_features))
        if self.quantization == "int8":
            return cpu_quant.q8_linear(x, self.qweight, self.scales, self.bias)
        assert self.mins is not None  # registered for int4
        return cpu_quant.q4_linear(x, self.qweight, self.scales, self.mins, self.bias)


class QuantEmbedding(QuantLinear):
    """A token embedding kept quantized (int8 blocks): lookups dequantize only the rows they take."""

    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__(dim, num_embeddings, bias=False, quantization="int8")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight[ids].float().view(*ids.shape, -1, 32)
        return (rows * self.scales[ids].float()[..., None]).flatten(-2)[..., : self.in_features]


def quantize_modules(model: CausalLM, quantization: str) -> None:
    """Swap the projections (and the embedding and lm_head, int8 in both modes) for quantized ones.

    int4 keeps the embedding and lm_head at int8, as llama.cpp's Q4 files do (SmolLM2's Q4_1 GGUF
    stores token_embd as Q8_0): the vocabulary projection is the one most sensitive to it.
    """
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Linear):
                mode = "int8" if child is model.lm_head else quantization
                setattr(module, name, QuantLinear(child.in_features, child.out_features, child.bias is not None, mode))
    embed = model.model.embed_tokens
    if isinstance(embed, nn.Embedding):  # as the projections: one already quantized stays as it is
        model.model.embed_tokens = QuantEmbedding(embed.num_embeddings, embed.embedding_dim)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.qkv_proj = Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.has_qkv_bias)
        self.o_proj = Linear(self.q_size, args.hidden_size, bias=False)
        self.scale = args.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        a = self.args
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, a.num_kv_heads, a.head_dim)
        if meta.rotary_rows is not None:  # CPU: q and k rotated together by the step's rows
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, a.num_heads + a.num_kv_heads, a.head_dim)
            qk = rotate_half_rows(qk, *meta.rotary_rows)
            q, k = qk[:, : a.num_heads], qk[:, a.num_heads :]
        else:
            q = qkv[:, : self.q_size].view(num_tokens, a.num_heads, a.head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(num_tokens, a.num_kv_heads, a.head_dim)
            q, k = apply_rotary(q, k, positions, cos_sin)
        k_cache, v_cache = kv  # [num_blocks, block_size, kv_heads, dim]
        flat_k = k_cache.view(-1, a.num_kv_heads, a.head_dim)
        flat_v = v_cache.view(-1, a.num_kv_heads, a.head_dim)
        flat_k.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        flat_v.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))

        out = q.new_empty(num_tokens, a.num_heads, a.head_dim)
        for start, end, block_table, ctx_len in meta.prefills:
            out[start:end] = self._prefill_attention(
                q[start:end], flat_k, flat_v, block_table, ctx_len, k_cache.shape[1]
            )
        d0 = num_tokens - meta.num_decode_tokens
        for i, (start, end, block_tables, context_lens) in enumerate(meta.decode_groups):
            out[d0 + start : d0 + end] = paged_attention_decode(
                q[d0 + start : d0 + end],
                k_cache,
                v_cache,
                block_tables,
                context_lens,
                self.scale,
                meta.decode_plans[i] if meta.decode_plans is not None else None,
            )
        return self.o_proj(out.view(num_tokens, self.q_size))

    def _prefill_attention(
        self,
        q: torch.Tensor,
        flat_k: torch.Tensor,
        flat_v: torch.Tensor,
        block_table: torch.Tensor,
        ctx_len: int,
        block_size: int,
    ) -> torch.Tensor:
        # q: [chunk, heads, dim] are the last `chunk` positions of a context of ctx_len tokens.
        a = self.args
        chunk = q.shape[0]
        slots = (block_table[:, None] * block_size + torch.arange(block_size, device=q.device)).reshape(-1)[:ctx_len]
        keys = flat_k.index_select(0, slots).to(q.dtype).transpose(0, 1)  # [kv_heads, ctx, dim]
        values = flat_v.index_select(0, slots).to(q.dtype).transpose(0, 1)
        q_pos = torch.arange(ctx_len - chunk, ctx_len, device=q.device)
        mask = torch.arange(ctx_len, device=q.device)[None, :] <= q_pos[:, None]  # [chunk, ctx]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys, values, attn_mask=mask, scale=self.scale, enable_gqa=a.num_heads != a.num_kv_heads
        )  # query head h reads kv head h // (heads / kv_heads), as HF's repeat_kv
        return out.transpose(0, 1)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_up_proj = Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, self.weight, self.eps, residual)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, cos_sin, kv, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DecoderStack(nn.Module):
    """Embeddings, decoder layers and the final norm: HF's `model.*` submodule."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        # _weight: no random init, the weights are loaded. On the meta device (load_model) that init,
        # normal_(), is a Python decomposition whose first call imports torch._dynamo: 2.5-3 CPU s
        # of every engine process's start.
        self.embed_tokens: nn.Embedding | QuantEmbedding = nn.Embedding(
            args.vocab_size, args.hidden_size, _weight=torch.empty(args.vocab_size, args.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class CausalLM(nn.Module):
    """Decoder-only transformer with HF parameter names (model.*, lm_head)."""

    def __init__(self, args: ModelArgs, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.args = args
        self.rotary = rotary  # cos/sin of every position, on the model's device
        self.model = DecoderStack(args)
        # a QuantLinear once quantize_modules swapped it (and the embedding for a QuantEmbedding)
        self.lm_head: Linear | QuantLinear = Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.tie_embeddings()

    def tie_embeddings(self) -> None:
        """Point the float lm_head at the embedding's weight (tie_word_embeddings; a quantized
        lm_head shares the embedding's quantized tensors instead: QuantLinear.share)."""
        lm_head, embed = self.lm_head, self.model.embed_tokens
        if not isinstance(lm_head, Linear) or not isinstance(embed, nn.Embedding):
            raise TypeError("tie_embeddings ties float weights; a quantized lm_head shares the embedding (share)")
        lm_head.weight = embed.weight

    def pack_weights(self) -> None:
        """Give every projection its oneDNN copy (CPU float32; see cpu_packed_gemm_available)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()

    @property
    def quantization(self) -> str:
        """ "int8" or "int4" when the projections are quantized (load_model's quantization), else "none"."""
        layer = self.model.layers[0] if len(self.model.layers) else None
        mlp = layer.mlp.gate_up_proj if isinstance(layer, DecoderLayer) else None
        return mlp.quantization if isinstance(mlp, QuantLinear) else "none"

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights hold in memory: parameters and quantized buffers once each (tied ones
        share), plus the oneDNN copies (packed_bytes)."""
        tensors = [*self.parameters(), *(b for b in self.buffers() if b is not None)]
        return sum({t.data_ptr(): t.numel() * t.element_size() for t in tensors}.values()) + self.packed_bytes

    @property
    def packed_bytes(self) -> int:
        """Bytes of the oneDNN weight copies pack_weights() made (0 when none)."""
        return sum(
            m.weight.numel() * m.weight.element_size()
            for m in self.modules()
            if isinstance(m, Linear) and m.packed is not None
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [tokens]. Returns float32 logits for meta.logits_indices rows."""
        x = self.model.embed_tokens(input_ids)
        residual = None
        rows, cos_sin = self.rotary.select(positions, meta.rope_seq_lens)
        if not use_triton(x):  # CPU: what every layer shares, made once per step
            meta.rotary_rows = rotary_rows(rows, cos_sin)
            block_size = kv_caches[0][0].shape[1]
            meta.decode_plans = [decode_plan(tables, lens, block_size) for _, _, tables, lens in meta.decode_groups]
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rows, cos_sin, kv, meta)
        x, _ = self.model.norm(x, residual)
        if meta.logits_indices is not None:
            x = x[meta.logits_indices]
        return self.lm_head(x).float()


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    return files


def weights_sha256(path: Path) -> str:
    """sha256 over the weight files in name order: the identity of the weights in audit records.
    Remembered per file identity (weir/digests.py): every start asked it again of the same bytes."""
    return cached_sha256(_weight_files(path))


def load_model(path: str | Path, device: torch.device, dtype: torch.dtype, quantization: str = "none") -> CausalLM:
    """Build the model from a HF directory (config.json + safetensors) on `device` in `dtype`.

    quantization "int8" / "int4" quantizes each projection as it is read (QuantLinear): no float32
    copy of the whole model is ever held, only the tensor at hand. The embedding stays a float
    tensor of `dtype` only with "none".
    """
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"quantization {quantization!r} is not one of {list(QUANTIZATIONS)}")
    if quantization != "none" and dtype != torch.float32:
        raise ModelLoadError(f"quantization {quantization!r} needs float32 activations, not {dtype}")
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise ModelLoadError(f"{path} has no config.json")
    generation_file = path / "generation_config.json"
    generation_config = json.loads(generation_file.read_text()) if generation_file.exists() else None
    args = ModelArgs.from_hf_config(json.loads(config_file.read_text()), generation_config)
    rotary = RotaryEmbedding(args.rope, args.head_dim, device)
    with torch.device("meta"):
        model = CausalLM(args, rotary)
        if quantization != "none":
            quantize_modules(model, quantization)
    if quantization == "none":
        model = model.to_empty(device=device).to(dtype)
        if args.tie_word_embeddings:  # to_empty gives each module its own tensor: tie again
            model.tie_embeddings()
    else:  # .to(float32) would turn the f16 scales into float32: the buffers keep their dtypes
        model = model.to_empty(device=device)
    params: dict[str, torch.Tensor | QuantLinear] = dict(model.named_parameters())
    params.update({f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, QuantLinear)})
    pending: dict[str, dict[str, torch.Tensor]] = {}
    loaded: set[str] = set()

    def put(name: str, tensor: torch.Tensor) -> None:
        if name not in params:
            raise ModelLoadError(f"unexpected weight {name!r} in {path}")
        target = params[name]
        shape = (target.out_features, target.in_features) if isinstance(target, QuantLinear) else target.shape
        if tuple(shape) != tuple(tensor.shape):
            raise ModelLoadError(f"weight {name!r}: shape {tuple(tensor.shape)} != expected {tuple(shape)}")
        with torch.no_grad():
            if isinstance(target, QuantLinear):
                target.load(tensor)
            else:
                target.copy_(tensor.to(device=device, dtype=dtype))
        loaded.add(name)

    fused = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open is no dict: keys() is its API
                if "rotary_emb.inv_freq" in key or (args.tie_word_embeddings and key == "lm_head.weight"):
                    continue
                tensor = fh.get_tensor(key)
                prefix, _, leaf = key.rpartition(".")  # e.g. model.layers.0.self_attn.q_proj, weight
                owner, _, proj = prefix.rpartition(".")
                if proj in fused:
                    target, part = fused[proj]
                    group = pending.setdefault(f"{owner}.{target}.{leaf}", {})
                    group[str(part)] = tensor
                    size = 3 if target == "qkv_proj" else 2
                    if len(group) == size:
                        put(f"{owner}.{target}.{leaf}", torch.cat([group[str(i)] for i in range(size)], dim=0))
                else:
                    put(key, tensor)
    if args.tie_word_embeddings:
        loaded.add("lm_head.weight")
        if quantization != "none":
            lm_head, embed = model.lm_head, model.model.embed_tokens
            assert isinstance(lm_head, QuantLinear) and isinstance(
                embed, QuantEmbedding
            )  # quantize_modules swapped them
            lm_head.share(embed)
    missing = set(params) - loaded
    if missing:
        raise ModelLoadError(f"{path} lacks weights: {sorted(missing)[:5]}")
    if device.type == "cpu" and dtype == torch.float32 and cpu_packed_gemm_available():
        model.pack_weights()  # the float32 projections left (none when quantized)
    if quantization != "none" and device.type == "cpu":
        _trim_heap()  # the float tensors read and quantized were freed: give their pages back
    return model.eval()


def _trim_heap() -> None:
    """glibc's malloc_trim(0), so resident memory shows the quantized model, not the freed reads."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass

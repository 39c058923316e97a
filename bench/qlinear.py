"""Quantized linear candidates on the CPU at SmolLM2-135M's shapes: one step's projections, every kernel.

    python -m bench qlinear [--batch 1 8 32] [--threads 1 2] [--rounds 5] [--native]    (or: weir bench qlinear)

A "step" is all the projections of one decode step of SmolLM2-135M (30 layers x qkv 576->960, o
576->576, gate_up 576->3072, down 1536->576, plus the tied lm_head 576->49152), each layer with its
own weights so nothing stays in cache between layers, as in serving. Each candidate runs the step
at every batch size and thread count; the figure is the median of --rounds alternating rounds
(candidates interleaved, so machine load hits them alike) in ms per step and tokens/s (batch / step).
Losers stay in the table: it is how the kernel was chosen (docs/benchmarks.md).

By default the process limits ATen, oneDNN and MKL to AVX2 (ATEN_CPU_CAPABILITY=avx2,
ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2): the machine Weir targets is an AVX2 + FMA
EPYC; --native lets them use whatever this CPU has.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported lazily (after _limit_isa), for annotations only here
    from torch import Tensor

K_HIDDEN, K_INTER, VOCAB, LAYERS = 576, 1536, 49152, 30
SHAPES = [
    ("qkv", K_HIDDEN, 960),
    ("o", K_HIDDEN, K_HIDDEN),
    ("gate_up", K_HIDDEN, 2 * K_INTER),
    ("down", K_INTER, K_HIDDEN),
]


def _limit_isa() -> None:
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
    os.environ.setdefault("MKL_ENABLE_INSTRUCTIONS", "AVX2")


def model_weights(torch):
    """[(K, N, float32 weight)] for one step: 30 layers' four projections, then the lm_head."""
    gen = torch.Generator().manual_seed(0)
    weights = [(k, n, torch.randn(n, k, generator=gen) * 0.05) for _ in range(LAYERS) for _, k, n in SHAPES]
    return weights + [(K_HIDDEN, VOCAB, torch.randn(VOCAB, K_HIDDEN, generator=gen) * 0.05)]


def candidates(torch, weights) -> dict[str, tuple[Callable[[dict[int, Tensor]], object], int]]:
    """name -> (run one step on inputs {K: x}, resident bytes of its weights)."""
    import torch.nn.functional as F

    from kernels import cpu_quant as cq

    out: dict[str, tuple[Callable, int]] = {}

    def nbytes(*tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for _, _, w in weights]
    out["float32 oneDNN packed (today)"] = (
        lambda xs: [
            torch.ops.mkldnn._linear_pointwise(xs[k], p, None, "none", [], "")
            for (k, _, _), p in zip(weights, packed, strict=True)
        ],
        sum(nbytes(w) for _, _, w in weights),
    )
    out["float32 F.linear (MKL)"] = (
        lambda xs: [F.linear(xs[k], w) for k, _, w in weights],
        sum(nbytes(w) for _, _, w in weights),
    )
    q8 = [cq.quantize_int8(w) for _, _, w in weights]
    q4 = [cq.quantize_int4(w) for _, _, w in weights]
    if cq.extension_available():
        out["weir int8 AVX2 (Q8_0 blocks)"] = (
            lambda xs: [
                torch.ops.weir_quant.q8_linear(xs[k], q, d, None) for (k, _, _), (q, d) in zip(weights, q8, strict=True)
            ],
            sum(nbytes(*t) for t in q8),
        )
        out["weir int4 AVX2 (Q4_1 blocks)"] = (
            lambda xs: [
                torch.ops.weir_quant.q4_linear(xs[k], q, d, m, None)
                for (k, _, _), (q, d, m) in zip(weights, q4, strict=True)
            ],
            sum(nbytes(*t) for t in q4),
        )
    else:
        print(f"weir AVX2 kernels unavailable: {cq.extension_error()}", file=sys.stderr)
    out["int8 dequantize-then-F.linear"] = (
        lambda xs: [F.linear(xs[k], cq.dequantize_int8(q, d)) for (k, _, _), (q, d) in zip(weights, q8, strict=True)],
        sum(nbytes(*t) for t in q8),
    )
    # torch's own: int8 per output channel (no blocks), and int4 groups of 32 with bf16 activations
    chan = []
    for _, _, w in weights:
        s = w.abs().amax(1) / 127.0
        chan.append((torch.round(w / s[:, None]).to(torch.int8), s))
    out["torch _weight_int8pack_mm (per-channel)"] = (
        lambda xs: [torch._weight_int8pack_mm(xs[k], q, s) for (k, _, _), (q, s) in zip(weights, chan, strict=True)],
        sum(nbytes(*t) for t in chan),
    )
    try:
        int4 = []
        for (_, _, w), (q, d, m) in zip(weights, q4, strict=True):
            values = torch.cat([q.reshape(q.shape[0], -1, 16) & 15, q.reshape(q.shape[0], -1, 16) >> 4], -1)
            wp = torch._convert_weight_to_int4pack_for_cpu(values.reshape(w.shape).to(torch.int32), 1)
            # its zero point is applied as (q - 8) * scale + zero: zero = m + 8 d
            sz = torch.stack([d.float(), m.float() + 8 * d.float()], -1).transpose(0, 1).contiguous().bfloat16()
            int4.append((wp, sz))
        out["torch _weight_int4pack_mm_for_cpu (bf16 x)"] = (
            lambda xs: [
                torch._weight_int4pack_mm_for_cpu(xs[k].bfloat16(), wp, 32, sz)
                for (k, _, _), (wp, sz) in zip(weights, int4, strict=True)
            ],
            sum(nbytes(*t) for t in int4),
        )
    except (RuntimeError, AttributeError) as exc:
        print(f"torch int4pack unavailable: {exc}", file=sys.stderr)
    ort = onnxruntime_candidate(weights, q4)
    if ort is not None:
        out["onnxruntime MatMulNBits 4-bit (int8 compute)"] = ort
    return out


def onnxruntime_candidate(weights, q4):
    """One ORT session holding the whole step's MatMulNBits nodes (one run per step: no per-call overhead)."""
    try:
        import numpy as np
        import onnxruntime as ort
        import torch
        from onnx import TensorProto, helper, numpy_helper
    except ImportError as exc:
        print(f"onnxruntime unavailable: {exc}", file=sys.stderr)
        return None
    nodes, inits, outputs = [], [], []
    for i, ((k, n, _), (q, d, m)) in enumerate(zip(weights, q4, strict=True)):
        # MatMulNBits: B uint8 [N, K/32, 16] (same nibble order as ggml: low nibble = even index), so
        # repack: value 2i in the low nibble, 2i+1 in the high one
        vals = torch.cat([q.reshape(n, -1, 16) & 15, q.reshape(n, -1, 16) >> 4], -1).reshape(n, k // 32, 16, 2)
        b = (vals[..., 0] | (vals[..., 1] << 4)).numpy().astype(np.uint8)
        scale = d.float().numpy().reshape(-1)
        # value = (q - zp) * scale with a float zero point is not offered; use uint8 zero points = round(-m / d)
        zp = np.clip(np.round(-m.float().numpy() / np.maximum(d.float().numpy(), 1e-8)), 0, 15).astype(np.uint8)
        zp_packed = (zp[:, 0::2] | (np.pad(zp[:, 1::2], ((0, 0), (0, zp.shape[1] % 2))) << 4)).reshape(-1)
        inits += [
            numpy_helper.from_array(b, f"b{i}"),
            numpy_helper.from_array(scale, f"s{i}"),
            numpy_helper.from_array(zp_packed.astype(np.uint8), f"z{i}"),
        ]
        nodes.append(
            helper.make_node(
                "MatMulNBits",
                [f"x{k}", f"b{i}", f"s{i}", f"z{i}"],
                [f"y{i}"],
                domain="com.microsoft",
                K=k,
                N=n,
                bits=4,
                block_size=32,
                accuracy_level=4,
            )
        )
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["B", n]))
    inputs = [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, ["B", k]) for k in (K_HIDDEN, K_INTER)]
    graph = helper.make_graph(nodes, "step", inputs, outputs, inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)], ir_version=10
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = int(os.environ.get("_QL_THREADS", "1"))
    try:
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - ORT raises its own types; the bench says why and goes on
        print(f"onnxruntime MatMulNBits unavailable: {exc}", file=sys.stderr)
        return None
    size = sum(t.nbytes for t in (numpy_helper.to_array(x) for x in inits))
    return (lambda xs: session.run(None, {f"x{k}": xs[k].numpy() for k in (K_HIDDEN, K_INTER)}), size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weir bench qlinear", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--native", action="store_true", help="let ATen/oneDNN/MKL use this CPU's full ISA")
    args = parser.parse_args(argv)
    if not args.native:
        _limit_isa()
    import torch

    print(
        f"torch {torch.__version__}, ATen capability {torch.backends.cpu.get_cpu_capability()}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}"
    )
    weights = model_weights(torch)
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        os.environ["_QL_THREADS"] = str(threads)
        cands = candidates(torch, weights)
        for batch in args.batch:
            xs = {k: torch.randn(batch, k) for k in (K_HIDDEN, K_INTER)}
            times: dict[str, list[float]] = {name: [] for name in cands}
            for run, _ in cands.values():
                run(xs)  # warm
            for _ in range(args.rounds):
                for name, (run, _) in cands.items():
                    start = time.perf_counter()
                    run(xs)
                    times[name].append(time.perf_counter() - start)
            for name, (_, size) in cands.items():
                ms = statistics.median(times[name]) * 1e3
                rows.append((threads, batch, name, ms, batch / ms * 1e3, size / 1e6))
                print(f"  {threads} threads, batch {batch}: {name} {ms:.1f} ms", file=sys.stderr, flush=True)
        del cands
    print("\n| threads | batch | kernel | ms / step | tokens/s | weights MB |\n|---|---|---|---|---|---|")
    for threads, batch, name, ms, tps, mb in rows:
        print(f"| {threads} | {batch} | {name} | {ms:.1f} | {tps:.0f} | {mb:.0f} |")
    return 0

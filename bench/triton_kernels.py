"""Time each Triton kernel against its PyTorch reference at serving-like sizes (CUDA only).

    python -m bench kernels [--out DIR] [--dtype bfloat16] [--quick]     (or: weir bench kernels ...)

Prints a table and writes bench_kernels.json and bench_kernels.md to --out (default $OUT, else
/tmp/weir-bench). Every timed case is also checked against the reference (max abs error and a
pass/fail under the kernel tests' tolerances), so a kernel that is fast and wrong shows as such.
Times are medians from triton.testing.do_bench, which flushes L2 between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch

DEV = "cuda"
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2.5e-2, 2.5e-2)}


def bench(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))


def check(actual, expected) -> tuple[float, bool]:
    pairs = list(zip(actual, expected, strict=True)) if isinstance(actual, tuple) else [(actual, expected)]
    err, ok = 0.0, True
    for a, e in pairs:
        err = max(err, (a.float() - e.float()).abs().max().item())
        atol, rtol = TOL[e.dtype]
        ok = ok and a.dtype == e.dtype and bool(torch.allclose(a.float(), e.float(), atol=atol, rtol=rtol))
    return err, ok


def cases(dtype: torch.dtype, quick: bool):
    """(op, case, bytes moved, triton fn, reference fn) for every kernel at serving-like sizes."""
    size = 2 if dtype != torch.float32 else 4
    tokens_list = [1, 256, 8192] if quick else [1, 32, 256, 2048, 8192]
    yield from rms_norm_cases(dtype, size, tokens_list)
    yield from silu_and_mul_cases(dtype, size, tokens_list)
    yield from rotary_cases(dtype, size, tokens_list)
    yield from paged_attention_cases(dtype, size, quick)


def rms_norm_cases(dtype: torch.dtype, size: int, tokens_list: list[int]):
    from kernels.norm import rms_norm_ref
    from kernels.triton_norm import rms_norm_triton

    hidden = 4096
    for t in tokens_list:
        x, r = torch.randn(t, hidden, device=DEV, dtype=dtype), torch.randn(t, hidden, device=DEV, dtype=dtype)
        w = torch.randn(hidden, device=DEV, dtype=dtype)
        yield (
            "rms_norm+residual",
            f"tokens={t} hidden={hidden}",
            5 * t * hidden * size,
            lambda x=x, r=r, w=w: rms_norm_triton(x, w, 1e-6, r),
            lambda x=x, r=r, w=w: rms_norm_ref(x, w, 1e-6, r),
        )


def silu_and_mul_cases(dtype: torch.dtype, size: int, tokens_list: list[int]):
    from kernels.activation import silu_and_mul_ref
    from kernels.triton_activation import silu_and_mul_triton

    inter = 14336
    for t in tokens_list:
        x = torch.randn(t, 2 * inter, device=DEV, dtype=dtype)
        yield (
            "silu_and_mul",
            f"tokens={t} d={inter}",
            3 * t * inter * size,
            lambda x=x: silu_and_mul_triton(x),
            lambda x=x: silu_and_mul_ref(x),
        )


def rotary_cases(dtype: torch.dtype, size: int, tokens_list: list[int]):
    from kernels.rotary import apply_rotary_ref, rope_cos_sin
    from kernels.triton_rotary import apply_rotary_triton

    heads, kv_heads, head_dim = 32, 8, 128
    cos_sin = rope_cos_sin(head_dim, 32768, 500_000.0, device=DEV)
    for t in tokens_list:
        qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, device=DEV, dtype=dtype)
        q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q, k = q.view(t, heads, head_dim), k.view(t, kv_heads, head_dim)
        pos = torch.randint(0, 32768, (t,), device=DEV)
        yield (
            "rotary",
            f"tokens={t} q={heads}x{head_dim} k={kv_heads}x{head_dim}",
            2 * t * (heads + kv_heads) * head_dim * size,
            lambda q=q, k=k, pos=pos: apply_rotary_triton(q, k, pos, cos_sin),
            lambda q=q, k=k, pos=pos: apply_rotary_ref(q, k, pos, cos_sin),
        )


def paged_attention_cases(dtype: torch.dtype, size: int, quick: bool):
    from kernels.paged_attention import paged_attention_decode_ref
    from kernels.triton_paged_attention import paged_attention_decode_triton

    page = 16
    attn = [(1, 1024), (32, 1024), (64, 4096), (128, 2048), (256, 512)]
    shapes = [(32, 8, 128)] if quick else [(32, 8, 128), (32, 32, 128), (16, 4, 64)]
    if quick:
        attn = [(1, 1024), (64, 4096), (256, 512)]
    block_ns = [64] if quick else [32, 64, 128]
    for heads, kv_heads, head_dim in shapes:
        for seqs, ctx in attn:
            if (heads, kv_heads) != (32, 8) and (seqs, ctx) not in [(32, 1024), (128, 2048)]:
                continue
            max_blocks = -(-ctx // page)
            num_blocks = seqs * max_blocks
            q = torch.randn(seqs, heads, head_dim, device=DEV, dtype=dtype)
            kc = torch.randn(num_blocks, page, kv_heads, head_dim, device=DEV, dtype=dtype)
            vc = torch.randn_like(kc)
            bt = torch.randperm(num_blocks, device=DEV).view(seqs, max_blocks).to(torch.int32)
            lens = torch.randint(ctx // 2, ctx + 1, (seqs,), device=DEV, dtype=torch.int32)
            lens[0] = ctx - 3
            kv_bytes = 2 * int(lens.sum()) * kv_heads * head_dim * size + 2 * seqs * heads * head_dim * size
            scale = head_dim**-0.5
            for bn in block_ns:
                yield (
                    f"paged_attention_decode[block_n={bn}]",
                    f"seqs={seqs} ctx<={ctx} heads={heads}/{kv_heads} dim={head_dim} page={page}",
                    kv_bytes,
                    lambda q=q, kc=kc, vc=vc, bt=bt, lens=lens, bn=bn, scale=scale: paged_attention_decode_triton(
                        q, kc, vc, bt, lens, scale, block_n=bn
                    ),
                    lambda q=q, kc=kc, vc=vc, bt=bt, lens=lens, scale=scale: paged_attention_decode_ref(
                        q, kc, vc, bt, lens, scale
                    ),
                )
            del q, kc, vc
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="weir bench kernels", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/weir-bench")
    ap.add_argument("--dtype", action="append", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--quick", action="store_true", help="fewer sizes")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("weir bench kernels: no CUDA device; nothing to time", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("weir bench kernels: unset TRITON_INTERPRET to time compiled kernels", file=sys.stderr)
        return 2
    import triton

    torch.manual_seed(0)
    rows = time_cases([getattr(torch, d) for d in (args.dtype or ["bfloat16"])], args.quick)
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    write_results(Path(args.out), meta, rows)
    return 0 if all(r["ok"] for r in rows) else 1


def time_cases(dtypes: list[torch.dtype], quick: bool) -> list[dict]:
    """Check and time every case of every dtype, printing each row as it comes."""
    rows = []
    header = (
        f"{'op':36} {'dtype':9} {'case':52} {'triton_ms':>10} {'torch_ms':>10} {'speedup':>8} {'GB/s':>8} "
        f"{'max_err':>9} ok"
    )
    print(header, flush=True)
    for dtype in dtypes:
        for op, case, nbytes, fn, ref in cases(dtype, quick):
            err, ok = check(fn(), ref())
            t_ms, r_ms = bench(fn), bench(ref)
            row = {
                "op": op,
                "dtype": str(dtype).removeprefix("torch."),
                "case": case,
                "triton_ms": t_ms,
                "torch_ms": r_ms,
                "speedup": r_ms / t_ms,
                "triton_GBps": nbytes / (t_ms * 1e-3) / 1e9,
                "max_abs_err": err,
                "ok": ok,
            }
            rows.append(row)
            print(
                f"{op:36} {row['dtype']:9} {case:52} {t_ms:10.4f} {r_ms:10.4f} {row['speedup']:8.2f} "
                f"{row['triton_GBps']:8.0f} {err:9.2e} {'ok' if ok else 'MISMATCH'}",
                flush=True,
            )
    return rows


def write_results(out: Path, meta: dict, rows: list[dict]) -> None:
    """bench_kernels.json (meta and rows) and bench_kernels.md (a table) in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_kernels.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [
        f"# Kernel bench: {meta['device']}, torch {meta['torch']}, triton {meta['triton']}",
        "",
        "| op | dtype | case | triton ms | torch ms | speedup | triton GB/s | max abs err | ok |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['op']} | {r['dtype']} | {r['case']} | {r['triton_ms']:.4f} | {r['torch_ms']:.4f} | "
            f"{r['speedup']:.2f} | {r['triton_GBps']:.0f} | {r['max_abs_err']:.2e} | "
            f"{'ok' if r['ok'] else 'MISMATCH'} |"
        )
    (out / "bench_kernels.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'bench_kernels.json'} and {out / 'bench_kernels.md'}")


if __name__ == "__main__":
    sys.exit(main())

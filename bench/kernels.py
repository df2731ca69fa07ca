"""Kernel benchmark: megazero's Triton attention and AdamW against torch's own kernels, on one CUDA GPU.

Attention (bf16, causal, head_dim 64 and 128, seq 1024..16384): megazero's FlashAttention-2
(``kernels.attention``, impl="triton") next to torch SDPA's FlashAttention backend and its cuDNN
backend. Every contender gets the same inputs, laid out as the model makes them (q, k, v strided
views of one (batch, seq, heads, 3, head_dim) qkv projection). batch = 16384 // seq and
heads = 2048 // head_dim, so every row is 16k tokens of a 2048-wide model. FLOPs are counted as
Dao 2023 (FlashAttention-2, §4.1) does: forward 4*b*h*s^2*d, halved when causal; forward +
backward = 3.5 x forward (the backward is 2.5 x). Times are medians of triton.testing.do_bench
(CUDA events, L2 flushed between runs), after one untimed call that also runs the autotuner.
Correctness: max |error| of bf16 O, dQ, dK, dV against SDPA's math backend in fp32 on a slice
(one sequence, two heads), for megazero and, as the yardstick, SDPA's bf16 flash backend.

AdamW over a flat fp32 buffer (256M elements by default) with bf16 grads and a bf16 model copy:
megazero's Triton kernel (``kernels.adam.adamw_step_triton``) and its torch fallback
(``kernels.adam.adamw_step``), counted as 28 bytes/element moved (read grad 2 + master 4 + m 4
+ v 4, write master 4 + m 4 + v 4 + model copy 2), next to the device's measured copy bandwidth
(2 x bytes / time of a 1 GiB device-to-device copy) and torch.optim.AdamW(fused=True) over 64
fp32 tensors of the same total size (fp32 grads, no model copy: 28 bytes/element too).

    python bench/kernels.py [--seqs 1024,2048,4096,8192,16384] [--adam-elements 268435456]

Prints markdown tables for docs/benchmarks.md. Not a test: nothing here asserts. Exits with code 2
and one line when there is no CUDA GPU.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
# The repository first, and not this script's folder: ``import kernels`` must find the package, not this file.
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or os.curdir) not in (ROOT, HERE)]

import argparse  # noqa: E402
import datetime  # noqa: E402
from typing import Callable, Optional  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HIDDEN, TOKENS = 2048, 16384
HEAD_DIMS = (64, 128)
ADAM = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
ADAM_BYTES = 2 + 4 + 4 + 4 + 4 + 4 + 4 + 2  # per element, see the module docstring
ADAM_TENSORS = 64


def attention_flops(b: int, h: int, s: int, d: int, causal: bool = True) -> tuple[float, float]:
    """(forward, forward + backward) FLOPs as Dao 2023 counts them."""
    fwd = 4.0 * b * h * s * s * d / (2 if causal else 1)
    return fwd, 3.5 * fwd


def _bench(fn: Callable[[], object]) -> Optional[float]:
    """Median ms of fn, or None when it cannot run here (e.g. an SDPA backend with no kernel for the input)."""
    from triton.testing import do_bench

    try:
        fn()  # compile / autotune outside the timed region, and check it runs at all
        torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001 -- one contender failing must not end the benchmark
        print(f"  (skipped: {str(err).splitlines()[0][:120]})", file=sys.stderr)
        return None
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _contenders() -> dict[str, Callable]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels.attention import attention

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return run

    return {"megazero triton": lambda q, k, v: attention(q, k, v, causal=True, impl="triton"),
            "sdpa flash": sdpa(SDPBackend.FLASH_ATTENTION),
            "sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}


def _qkv(b: int, s: int, h: int, d: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(b, s, h, 3, d, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
    return q, k, v, torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)


def _fmt(x: Optional[float], spec: str = ".0f") -> str:
    return "n/a" if x is None else format(x, spec)


def bench_attention(seqs: list[int]) -> list[str]:
    names = list(_contenders())
    rows = ["| seq | head_dim | batch x heads | " + " | ".join(f"{n} fwd" for n in names) + " | "
            + " | ".join(f"{n} fwd+bwd" for n in names) + " |",
            "|" + "---|" * (3 + 2 * len(names))]
    for d in HEAD_DIMS:
        for s in seqs:
            b, h = max(1, TOKENS // s), HIDDEN // d
            print(f"attention: seq {s}, head_dim {d}, batch {b} x heads {h}", file=sys.stderr)
            q, k, v, dout = _qkv(b, s, h, d, torch.bfloat16)
            flops_fwd, flops_all = attention_flops(b, h, s, d)
            fwd, both = [], []
            for name, fn in _contenders().items():
                ms = _bench(lambda: fn(q, k, v))
                fwd.append(None if ms is None else flops_fwd / ms / 1e9)
                ms = _bench(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout))
                both.append(None if ms is None else flops_all / ms / 1e9)
            rows.append(f"| {s} | {d} | {b} x {h} | " + " | ".join(_fmt(x) for x in fwd + both) + " |")
            del q, k, v, dout
            torch.cuda.empty_cache()
    return rows


def check_attention(seqs: list[int]) -> list[str]:
    """bf16 max |error| against SDPA's fp32 math backend on one sequence and two heads."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    contenders = {k: v for k, v in _contenders().items() if k in ("megazero triton", "sdpa flash")}
    rows = ["| seq | head_dim | impl | O | dQ | dK | dV |", "|---|---|---|---|---|---|---|"]
    for d in HEAD_DIMS:
        for s in seqs:
            q, k, v, dout = _qkv(1, s, 2, d, torch.bfloat16, seed=1)
            ref_in = [x.detach().float().requires_grad_() for x in (q, k, v)]
            with sdpa_kernel(SDPBackend.MATH):
                ref_out = F.scaled_dot_product_attention(*ref_in, is_causal=True)
            ref = [ref_out, *torch.autograd.grad(ref_out, ref_in, dout.float())]
            del ref_in, ref_out
            for name, fn in contenders.items():
                try:
                    out = fn(q, k, v)
                    got = [out, *torch.autograd.grad(out, (q, k, v), dout)]
                    errs = [_fmt((g.float() - r).abs().max().item(), ".2e") for g, r in zip(got, ref)]
                except Exception as err:  # noqa: BLE001
                    errs = [f"failed: {str(err).splitlines()[0][:60]}"] + [""] * 3
                rows.append(f"| {s} | {d} | {name} | " + " | ".join(errs) + " |")
            del ref
            torch.cuda.empty_cache()
    return rows


def bench_adam(n: int) -> list[str]:
    rows = ["| what | bytes/element | ms | GB/s | of copy bandwidth |", "|---|---|---|---|---|"]
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = _bench(lambda: dst.copy_(src))
    copy_gbs = 2 * src.numel() / copy_ms / 1e6
    rows.append(f"| device-to-device copy (1 GiB) | - | {copy_ms:.2f} | {copy_gbs:.0f} | 100% |")
    del src, dst

    def row(what: str, ms: Optional[float], bytes_per: int = ADAM_BYTES) -> str:
        gbs = None if ms is None else bytes_per * n / ms / 1e6
        share = "n/a" if gbs is None else f"{100 * gbs / copy_gbs:.0f}%"
        return f"| {what} | {bytes_per} | {_fmt(ms, '.2f')} | {_fmt(gbs)} | {share} |"

    import kernels.adam as adam

    master = torch.randn(n, device="cuda")
    grad = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    model = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    args = (master, grad, exp_avg, exp_avg_sq)
    triton_step = getattr(adam, "adamw_step_triton", None)
    if triton_step is None:
        print("adam triton kernel not available", file=sys.stderr)
        rows.append(row("megazero triton AdamW (not available)", None))
    else:
        rows.append(row("megazero triton AdamW, flat, bf16 grad + bf16 copy",
                        _bench(lambda: triton_step(*args, **ADAM, step=10, model_copy=model))))
    rows.append(row("megazero torch adamw_step, flat, bf16 grad + bf16 copy",
                    _bench(lambda: adam.adamw_step(*args, **ADAM, step=10, model_copy=model))))
    del master, grad, exp_avg, exp_avg_sq, model, args
    torch.cuda.empty_cache()

    sizes = [n // ADAM_TENSORS + (i < n % ADAM_TENSORS) for i in range(ADAM_TENSORS)]
    params = [torch.randn(m, device="cuda").requires_grad_() for m in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=ADAM["lr"], betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"],
                            weight_decay=ADAM["weight_decay"], fused=True)
    rows.append(row(f"torch.optim.AdamW(fused=True), {ADAM_TENSORS} fp32 tensors", _bench(opt.step),
                    4 + 4 + 4 + 4 + 4 + 4 + 4))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    parser.add_argument("--adam-elements", type=int, default=256 * 2**20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU: torch.cuda.is_available() is False here", file=sys.stderr)
        sys.exit(2)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("bench/kernels.py times compiled kernels: unset TRITON_INTERPRET", file=sys.stderr)
        sys.exit(2)
    try:
        import triton
    except ImportError:
        print("bench/kernels.py needs triton (pip install triton)", file=sys.stderr)
        sys.exit(2)
    seqs = [int(x) for x in args.seqs.split(",")]
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32

    attn = bench_attention(seqs)
    check = check_attention(seqs)
    adam_rows = bench_adam(args.adam_elements)
    print(f"## Kernels: {torch.cuda.get_device_name()}, {datetime.date.today().isoformat()}")
    print(f"\ntorch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}\n")
    print(f"### Attention, bf16, causal: TFLOP/s (batch = {TOKENS} // seq, heads = {HIDDEN} // head_dim)\n")
    print("\n".join(attn))
    print("\n### Attention, bf16: max |error| against SDPA math in fp32 (1 sequence, 2 heads)\n")
    print("\n".join(check))
    print(f"\n### AdamW over {args.adam_elements / 2**20:.0f}M elements\n")
    print("\n".join(adam_rows))


if __name__ == "__main__":
    main()

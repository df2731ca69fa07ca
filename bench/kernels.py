"""Kernel benchmark: megazero's Triton attention and AdamW against torch's own kernels, on one CUDA GPU.

Attention (bf16, causal, head_dim 64 and 128, seq 1024..16384): megazero's FlashAttention-2
(``kernels.attention``, impl="triton"; with its default deterministic dQ pass and with dQ by atomic
adds) next to torch SDPA's FlashAttention backend and its cuDNN backend. Every contender gets the same inputs, laid out as the model makes them (q, k, v strided
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

Prints markdown tables for docs/benchmarks.md, then the kernel targets as measured ratios (attention
forward+backward against SDPA flash at head dim 128 and seq >= 4096; AdamW against the copy bandwidth
and against fused torch AdamW; bf16 errors against SDPA flash's own). Not a test: nothing here
asserts. Exits with code 2 and one line when there is no CUDA GPU.

Document masks (packed samples, documents of DOC_TOKENS tokens): megazero's kernel with ``documents=`` against
itself causal-only and against torch SDPA with the same boolean mask (``kernels.attend``'s fallback), fwd+bwd ms.

``--smoke`` runs every code path at toy sizes on the CPU, the kernels under Triton's interpreter
(TRITON_INTERPRET=1, set by this script before triton is imported), timed by wall clock: it checks
the script, not the kernels' speed (tests/bench/test_bench_kernels.py runs it).
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

if "--smoke" in sys.argv:  # before triton is imported anywhere: the interpreter is chosen at import
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.kernel_timing import Sizes, attention_flops, bench_ms, emit, fmt, release  # noqa: E402

ADAM = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
ADAM_BYTES = 2 + 4 + 4 + 4 + 4 + 4 + 4 + 2  # per element, see the module docstring
ADAM_TENSORS = 64
# The kernels' targets on Hopper: attention forward+backward >= SDPA flash at head dim 128 and seq >= 4096;
# AdamW >= 85% of the copy bandwidth and no slower than fused torch AdamW.
TARGET_HEAD_DIM, TARGET_MIN_SEQ, TARGET_COPY_SHARE = 128, 4096, 0.85
# bf16 errors: megazero's and SDPA flash's outputs both round to bf16 after fp32 accumulation, so against
# the fp32 reference megazero may differ by its own roundings; twice SDPA flash's error is the bar.
ERROR_FACTOR = 2.0


def _contenders() -> dict[str, Callable]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megazero.kernels.attend import attention

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return run

    return {"megazero triton": lambda q, k, v: attention(q, k, v, causal=True, impl="triton"),
            "megazero atomic dQ": lambda q, k, v: attention(q, k, v, causal=True, impl="triton", dq_mode="atomic"),
            "sdpa flash": sdpa(SDPBackend.FLASH_ATTENTION),
            "sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}


def _qkv(b: int, s: int, h: int, d: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """q, k, v as the model makes them (strided views of one qkv projection), and a strided dO."""
    gen = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(b, s, h, 3, d, device=device, dtype=dtype, generator=gen).requires_grad_()
    q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
    return q, k, v, torch.randn(b, s, h, d, device=device, dtype=dtype, generator=gen).transpose(1, 2)


def bench_attention(sz: Sizes, dtype: torch.dtype) -> dict:
    """Prints the table; returns {(head_dim, seq, name, "fwd" | "fwd+bwd"): TFLOP/s or None}."""
    names = list(_contenders())
    emit("| seq | head_dim | batch x heads | " + " | ".join(f"{n} fwd" for n in names) + " | "
          + " | ".join(f"{n} fwd+bwd" for n in names) + " |", "|" + "---|" * (3 + 2 * len(names)))
    results = {}
    for d in sz.head_dims:
        for s in sz.seqs:
            b, h = max(1, sz.tokens // s), sz.hidden // d
            print(f"attention: seq {s}, head_dim {d}, batch {b} x heads {h}", file=sys.stderr)
            q, k, v, dout = _qkv(b, s, h, d, dtype, sz.device)
            flops_fwd, flops_all = attention_flops(b, h, s, d)
            for name, fn in _contenders().items():
                ms = bench_ms(lambda: fn(q, k, v), sz.device)
                results[d, s, name, "fwd"] = None if ms is None else flops_fwd / ms / 1e9
                ms = bench_ms(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout), sz.device)
                results[d, s, name, "fwd+bwd"] = None if ms is None else flops_all / ms / 1e9
            cells = [results[d, s, n, w] for w in ("fwd", "fwd+bwd") for n in names]
            emit(f"| {s} | {d} | {b} x {h} | " + " | ".join(fmt(x) for x in cells) + " |")
            del q, k, v, dout
            release(sz.device)
    return results


def check_attention(sz: Sizes, dtype: torch.dtype) -> dict:
    """Max |error| of O, dQ, dK, dV against SDPA's math backend in fp32 on one sequence and two heads.

    Prints the table; returns {(head_dim, seq, name): [errors] or None where it failed}."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    contenders = {k: v for k, v in _contenders().items() if k != "sdpa cudnn"}
    emit("| seq | head_dim | impl | O | dQ | dK | dV |", "|---|---|---|---|---|---|---|")
    errors = {}
    for d in sz.head_dims:
        for s in sz.seqs:
            q, k, v, dout = _qkv(1, s, 2, d, dtype, sz.device, seed=1)
            ref_in = [x.detach().float().requires_grad_() for x in (q, k, v)]
            with sdpa_kernel(SDPBackend.MATH):
                ref_out = F.scaled_dot_product_attention(*ref_in, is_causal=True)
            ref = [ref_out, *torch.autograd.grad(ref_out, ref_in, dout.float())]
            del ref_in, ref_out
            for name, fn in contenders.items():
                try:
                    out = fn(q, k, v)
                    got = [out, *torch.autograd.grad(out, (q, k, v), dout)]
                    errors[d, s, name] = [(g.float() - r).abs().max().item() for g, r in zip(got, ref)]
                    cells = [fmt(e, ".2e") for e in errors[d, s, name]]
                except Exception as err:  # noqa: BLE001
                    errors[d, s, name] = None
                    cells = [f"failed: {(str(err).splitlines() or [type(err).__name__])[0][:60]}"] + [""] * 3
                emit(f"| {s} | {d} | {name} | " + " | ".join(cells) + " |")
            del ref
            release(sz.device)
    return errors


def bench_adam(sz: Sizes) -> dict:
    """Prints the table; returns {"copy" | "triton" | "torch" | "fused": GB/s or None, and "<same>_ms"}."""
    n, device = sz.adam_elements, sz.device
    emit("| what | bytes/element | ms | GB/s | of copy bandwidth |", "|---|---|---|---|---|")
    copy_bytes = 1 << 30 if device.type == "cuda" else 1 << 20
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src), device)
    copy_gbs = 2 * src.numel() / copy_ms / 1e6
    out = {"copy": copy_gbs, "copy_ms": copy_ms}
    emit(f"| device-to-device copy ({copy_bytes / 2**20:.0f} MiB) | - | {copy_ms:.2f} | {copy_gbs:.0f} | 100% |")
    del src, dst

    def row(key: str, what: str, ms: Optional[float], bytes_per: int = ADAM_BYTES) -> str:
        gbs = None if ms is None else bytes_per * n / ms / 1e6
        out[key], out[key + "_ms"] = gbs, ms
        share = "n/a" if gbs is None else f"{100 * gbs / copy_gbs:.0f}%"
        return f"| {what} | {bytes_per} | {fmt(ms, '.2f')} | {fmt(gbs)} | {share} |"

    import megazero.kernels.adam as adam

    master = torch.randn(n, device=device)
    grad = torch.randn(n, device=device, dtype=torch.bfloat16)
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    model = torch.empty(n, device=device, dtype=torch.bfloat16)
    args = (master, grad, exp_avg, exp_avg_sq)
    emit(row("triton", "megazero triton AdamW, flat, bf16 grad + bf16 copy", bench_ms(
        lambda: adam.adamw_step_triton(*args, **ADAM, step=10, model_copy=model), device)))
    emit(row("torch", "megazero torch adamw_step, flat, bf16 grad + bf16 copy", bench_ms(
        lambda: adam.adamw_step(*args, **ADAM, step=10, model_copy=model), device)))
    del master, grad, exp_avg, exp_avg_sq, model, args
    release(device)

    sizes = [n // ADAM_TENSORS + (i < n % ADAM_TENSORS) for i in range(ADAM_TENSORS)]
    params = [torch.randn(m, device=device).requires_grad_() for m in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=ADAM["lr"], betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"],
                            weight_decay=ADAM["weight_decay"], fused=True)
    emit(row("fused", f"torch.optim.AdamW(fused=True), {ADAM_TENSORS} fp32 tensors",
                    bench_ms(opt.step, device), 4 + 4 + 4 + 4 + 4 + 4 + 4))
    return out


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b == 0 else a / b


def targets(sz: Sizes, attn: dict, errors: dict, adam: dict, dtype_name: str) -> list[str]:
    """One line per kernel target: the measured ratio and whether it is met (MET / MISSED / n/a)."""
    def verdict(ok: Optional[bool]) -> str:
        return "n/a" if ok is None else ("MET" if ok else "MISSED")

    lines = []
    for s in sz.seqs:
        if s < TARGET_MIN_SEQ or TARGET_HEAD_DIM not in sz.head_dims:
            continue
        for name in ("megazero triton", "megazero atomic dQ"):
            r = _ratio(attn.get((TARGET_HEAD_DIM, s, name, "fwd+bwd")),
                       attn.get((TARGET_HEAD_DIM, s, "sdpa flash", "fwd+bwd")))
            lines.append(f"- attention fwd+bwd, {name}, head_dim {TARGET_HEAD_DIM}, seq {s}: / sdpa flash = "
                         f"{fmt(r, '.2f')} (target >= 1.00): {verdict(None if r is None else r >= 1.0)}")
    share = _ratio(adam.get("triton"), adam.get("copy"))
    lines.append(f"- AdamW: megazero triton / copy bandwidth = {fmt(share, '.2f')} (target >= "
                 f"{TARGET_COPY_SHARE:.2f}): {verdict(None if share is None else share >= TARGET_COPY_SHARE)}")
    speed = _ratio(adam.get("fused_ms"), adam.get("triton_ms"))  # same element count: time ratio
    lines.append(f"- AdamW: fused torch time / megazero triton time = {fmt(speed, '.2f')} (target >= 1.00): "
                 f"{verdict(None if speed is None else speed >= 1.0)}")
    for (d, s, name), errs in sorted(errors.items()):
        if not name.startswith("megazero"):
            continue
        ref = errors.get((d, s, "sdpa flash"))
        if errs is None or ref is None:
            lines.append(f"- {dtype_name} errors, {name}, head_dim {d}, seq {s}: n/a (a contender failed)")
            continue
        worst = max(e / max(r, 1e-6) for e, r in zip(errs, ref))
        lines.append(f"- {dtype_name} errors, {name}, head_dim {d}, seq {s}: worst of O/dQ/dK/dV / sdpa flash = "
                     f"{worst:.2f} (target <= {ERROR_FACTOR:.1f}): {verdict(worst <= ERROR_FACTOR)}")
    return lines


DOC_SEQ, DOC_TOKENS = 4096, 1024  # the document-masked row: 4 documents of 1k tokens per 4k sample


def timed(fn: Callable[[], object], device: torch.device) -> Optional[float]:
    """bench_ms on a GPU; --smoke: one wall-clock call (the interpreter's time says nothing; the path is checked)."""
    if device.type == "cuda":
        return bench_ms(fn, device)
    t0 = datetime.datetime.now()
    fn()
    return (datetime.datetime.now() - t0).total_seconds() * 1e3


def bench_documents(sz: Sizes, dtype: torch.dtype) -> None:
    """Prints one row: fwd+bwd ms of causal attention over packed documents (head dim 128, or the smoke's first),
    megazero with the document mask (skipping cross-document tiles) vs causal only vs SDPA with a boolean mask."""
    from megazero.kernels.attend import attention

    s = DOC_SEQ if sz.device.type == "cuda" else sz.seqs[0]
    per = DOC_TOKENS if sz.device.type == "cuda" else max(1, s // 4)
    d = TARGET_HEAD_DIM if TARGET_HEAD_DIM in sz.head_dims and sz.device.type == "cuda" else sz.head_dims[0]
    b, h = (max(1, sz.tokens // s), sz.hidden // d) if sz.device.type == "cuda" else (1, 2)
    q, k, v, dout = _qkv(b, s, h, d, dtype, sz.device)
    docs = (torch.arange(s, device=sz.device) // per).to(torch.int32).expand(b, s)
    runs = {"megazero triton, documents": lambda: attention(q, k, v, impl="triton", documents=docs),
            "megazero triton, causal only": lambda: attention(q, k, v, impl="triton"),
            "sdpa, boolean document mask": lambda: attention(q, k, v, impl="torch", documents=docs)}
    emit("| seq | head_dim | batch x heads | document tokens | " + " | ".join(runs) + " |", "|---" * (4 + len(runs))
         + "|")
    ms = [timed(lambda fn=fn: torch.autograd.grad(fn(), (q, k, v), dout), sz.device) for fn in runs.values()]
    emit(f"| {s} | {d} | {b} x {h} | {per} | " + " | ".join(fmt(x, ".2f") for x in ms) + " |")
    release(sz.device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default=",".join(map(str, Sizes.seqs)))
    parser.add_argument("--adam-elements", type=int, default=Sizes.adam_elements)
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU interpreter: checks the script")
    args = parser.parse_args()
    try:
        import triton
    except ImportError:
        print("bench/kernels.py needs triton (pip install triton)", file=sys.stderr)
        sys.exit(2)
    if args.smoke:
        sz, dtype = Sizes(torch.device("cpu"), hidden=128, tokens=128, head_dims=(64, 128), seqs=(64,),
                          adam_elements=4099), torch.float32  # the interpreter computes bf16 wrongly
    else:
        if not torch.cuda.is_available():
            print("bench/kernels.py needs a CUDA GPU: torch.cuda.is_available() is False here (--smoke runs "
                  "the script on the CPU)", file=sys.stderr)
            sys.exit(2)
        if os.environ.get("TRITON_INTERPRET") == "1":
            print("bench/kernels.py times compiled kernels: unset TRITON_INTERPRET", file=sys.stderr)
            sys.exit(2)
        sz = Sizes(torch.device("cuda"), seqs=tuple(int(x) for x in args.seqs.split(",")),
                   adam_elements=args.adam_elements)
        dtype = torch.bfloat16
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32

    where = torch.cuda.get_device_name() if sz.device.type == "cuda" else "CPU (--smoke: Triton interpreter)"
    dt = str(dtype).replace("torch.", "")
    emit(f"## Kernels: {where}, {datetime.date.today().isoformat()}",
          f"\ntorch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}\n",
          f"### Attention, {dt}, causal: TFLOP/s (batch = {sz.tokens} // seq, heads = {sz.hidden} // head_dim)\n")
    attn = bench_attention(sz, dtype)
    emit(f"\n### Attention, {dt}: max |error| against SDPA math in fp32 (1 sequence, 2 heads)\n")
    errors = check_attention(sz, dtype)
    emit(f"\n### AdamW over {sz.adam_elements} elements ({sz.adam_elements / 2**20:.0f} Mi)\n")
    adam = bench_adam(sz)
    emit("\n### Targets\n", *targets(sz, attn, errors, adam, dt))
    # last: the grouped-query kernel's first runs on a GPU; a fault there must not cost the results above
    from bench.kernels_gqa import gqa_shape, bench_gqa

    d, _, group = gqa_shape(sz)
    emit(f"\n### Grouped-query attention, {dt}, causal, head_dim {d}, {group} query heads per k/v head: fwd+bwd "
          f"TFLOP/s and max |error| against SDPA math in fp32 (one k/v head and its group)\n")
    try:
        bench_gqa(sz, dtype)
    except Exception as err:  # noqa: BLE001
        emit(f"failed: {(str(err).splitlines() or [type(err).__name__])[0][:200]}")
    emit(f"\n### Document-masked attention, {dt}, causal: fwd+bwd ms\n")
    try:  # after the GQA section for the same reason: the document-mask kernel's first GPU runs
        bench_documents(sz, dtype)
    except Exception as err:  # noqa: BLE001
        emit(f"failed: {(str(err).splitlines() or [type(err).__name__])[0][:200]}")


if __name__ == "__main__":
    main()

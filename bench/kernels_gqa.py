"""Grouped-query attention for bench/kernels.py: megazero's kernel against SDPA's enable_gqa and flash on k/v
repeated to every head, TFLOP/s and fp32 error (run last by bench/kernels.py; not a script of its own)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.kernel_timing import Sizes, attention_flops, bench_ms, emit, fmt, release


GQA_GROUP = 8  # query heads per k/v head, as Llama 3 8B (32 over 8) and 70B (64 over 8)


def gqa_shape(sz: Sizes) -> tuple[int, int, int]:
    """(head_dim, query heads, group): head dim 128 where the width holds two such heads (--smoke: 64)."""
    d = max(sz.head_dims) if sz.hidden // max(sz.head_dims) >= 2 else min(sz.head_dims)
    h = sz.hidden // d
    return d, h, min(GQA_GROUP, h)


def bench_gqa(sz: Sizes, dtype: torch.dtype) -> dict:
    """Grouped-query attention at head dim 128 (``gqa_shape``): megazero's kernel reading each
    k/v head for its whole group, against SDPA with ``enable_gqa`` and SDPA flash on k/v repeated to every
    head (what a model without GQA support does). fwd+bwd TFLOP/s (counted as for every query head), and the
    worst of O, dQ, dK, dV against SDPA math in fp32 on repeated k/v. Returns {(seq, name): (TFLOP/s, error)}."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megazero.kernels.attend import attention

    d, h, group = gqa_shape(sz)
    kv = h // group

    def repeated(fn):
        return lambda q, k, v: fn(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))

    def sdpa(backend, gqa):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return run if gqa else repeated(run)

    contenders = {"megazero triton": lambda q, k, v: attention(q, k, v, causal=True, impl="triton"),
                  "sdpa flash enable_gqa": sdpa(SDPBackend.FLASH_ATTENTION, True),
                  "sdpa cudnn enable_gqa": sdpa(SDPBackend.CUDNN_ATTENTION, True),
                  "sdpa flash, k/v repeated": sdpa(SDPBackend.FLASH_ATTENTION, False)}
    emit(f"| seq | batch x heads (k/v heads) | " + " | ".join(f"{n} fwd+bwd" for n in contenders) + " | "
          + " | ".join(f"{n} error" for n in contenders) + " |", "|" + "---|" * (2 + 2 * len(contenders)))
    results = {}
    for s in sz.seqs:
        b = max(1, sz.tokens // s)
        gen = torch.Generator(device=sz.device).manual_seed(2)
        q = torch.randn(b, h, s, d, device=sz.device, dtype=dtype, generator=gen).requires_grad_()
        k, v = (torch.randn(b, kv, s, d, device=sz.device, dtype=dtype, generator=gen).requires_grad_()
                for _ in range(2))
        dout = torch.randn(b, h, s, d, device=sz.device, dtype=dtype, generator=gen)
        # the error reference: one sequence, one k/v head and its group of query heads (dK, dV summed over it)
        one = [q[:1, :group], k[:1, :1], v[:1, :1]]
        ref_in = [x.detach().float().requires_grad_() for x in one]
        with sdpa_kernel(SDPBackend.MATH):
            ref_out = F.scaled_dot_product_attention(ref_in[0], *(x.repeat_interleave(group, 1) for x in ref_in[1:]),
                                                     is_causal=True)
        ref = [ref_out, *torch.autograd.grad(ref_out, ref_in, dout[:1, :group].float())]
        del ref_in, ref_out
        _, flops_all = attention_flops(b, h, s, d)
        for name, fn in contenders.items():
            ms = bench_ms(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout), sz.device)
            try:
                one = [x.detach().contiguous().requires_grad_() for x in (q[:1, :group], k[:1, :1], v[:1, :1])]
                out = fn(*one)
                got = [out, *torch.autograd.grad(out, one, dout[:1, :group])]
                error = max((g.float() - r).abs().max().item() for g, r in zip(got, ref))
            except Exception:  # noqa: BLE001 (a backend that cannot run this shape: n/a)
                error = None
            results[s, name] = (None if ms is None else flops_all / ms / 1e9, error)
        emit(f"| {s} | {b} x {h} ({kv}) | " + " | ".join(fmt(results[s, n][0]) for n in contenders) + " | "
              + " | ".join(fmt(results[s, n][1], ".2e") for n in contenders) + " |")
        del q, k, v, dout, ref
        release(sz.device)
    return results

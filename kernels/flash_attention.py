"""FlashAttention-2 (Dao 2023, "FlashAttention-2: Faster Attention with Better
Parallelism and Work Partitioning") in Triton, behind ``kernels.attention`` (``kernels.attend``):

- forward (§3.1.1, Algorithm 1), here: one program per (query block, batch*head), an online
  softmax over key blocks with one rescale of the output at the end; the S x S scores
  never exist; it saves the per-row log-sum-exp L (fp32).
- backward (§3.1.2, Algorithm 2): ``kernels.flash_backward``; P is recomputed from Q, K, L;
  dQ by a second deterministic pass, or by §3.2's atomic adds (``dq_mode``).
- causal: blocks above the diagonal are skipped by the loop bounds (``kernels.flash_blocks``).
- grouped-query attention (Ainslie et al. 2023, "GQA: Training Generalized Multi-Query Transformer
  Models from Multi-Head Checkpoints"): k and v may have fewer heads, a divisor of q's; query head h
  reads key/value head h // group through the pointers, with no repeated copy of k or v; the backward
  sums each group's dK, dV inside one program (``kernels.flash_backward``). The group is a compile-time
  constant; group 1 (multi-head attention) takes the same path and compiles to the PTX the kernels had
  before GQA.

Head dims up to 128: a head dim that is not a power of two (80, 96, ...) is padded up to one in
registers, its extra lanes loaded as zero and never stored; powers of two compile exactly as
without the padding. Scores are kept in base 2 (the softmax scale folded with log2(e), every
exponential an ``exp2``); accumulation is fp32 for every input dtype. q/k/v/dO are read through
their strides (the model's views of its fused qkv projection are not contiguous).

Under ``TRITON_INTERPRET=1`` (set before triton is first imported: ``triton.jit`` decides
at decoration time, for triton's own ``tl.sum`` too) the same kernels run on the CPU
interpreter with one small fixed block shape instead of autotuning.
"""

from __future__ import annotations

import math
from types import MappingProxyType

import torch
from torch import Tensor

from kernels.attention_configs import configs_for, head_dim_class
from kernels.flash_backward import _bwd_delta_kernel, _bwd_dkdv_kernel, _bwd_dq_kernel
from kernels.flash_blocks import (LOG2E, _block_tile, _fwd_bounds, _interpreting, _jit, _keep, _key_block,
                                   block_d, tl, triton)

# Fixed (BLOCK_M, BLOCK_N) per kernel under the interpreter; uneven on purpose so the
# bound arithmetic for BLOCK_M != BLOCK_N is what the CPU tests exercise.
INTERPRETER_BLOCKS = MappingProxyType({"fwd": (32, 16), "dkdv": (16, 32), "dq": (32, 16), "dkdvq": (16, 32)})
DQ_MODES = ("separate", "atomic")



# --- forward (Dao 2023 Algorithm 1) ------------------------------------------------------------


@_jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, skn, skd, svn, svd, offs_m, lo, hi, N_CTX, qk_scale,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
               PRECISION: tl.constexpr, BLOCK_D: tl.constexpr):
    visits = 0
    for start_n in range(lo, hi, BLOCK_N):
        offs_n, kt, v = _key_block(k_base, v_base, skn, skd, svn, svd, start_n, N_CTX, HEAD_DIM, BLOCK_N, BLOCK_D,
                                   False)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # log2-domain scores, fp32
        if MASKED:
            s = tl.where(_keep(offs_m, offs_n, N_CTX, CAUSAL), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: the first block visited always holds key 0
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
        visits += 1
    return acc, l_i, m_i, visits


@_jit
def _fwd_kernel(Q, K, V, O, LSE, VISITS, qk_scale,
                sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod, H, N_CTX,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                COUNT_VISITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """O and L for one query block (Algorithm 1; §3.2: one program per block, no cross-block sync).

    GQA: query head h reads key/value head h // GROUP in place (GROUP = 1: multi-head attention)."""
    pid, hz = tl.program_id(0), tl.program_id(1)
    b, h = (hz // H).to(tl.int64), (hz % H).to(tl.int64)
    hk = h // GROUP
    offs_m, offs_d, rows, tile = _block_tile(pid, N_CTX, BLOCK_M, HEAD_DIM, BLOCK_D)
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=tile, other=0.0)
    k_base, v_base = K + b * skb + hk * skh, V + b * svb + hk * svh
    m_i, l_i = tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    split, end = _fwd_bounds(pid, N_CTX, CAUSAL, BLOCK_M, BLOCK_N)
    acc, l_i, m_i, n1 = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, skn, skd, svn, svd, offs_m, 0, split, N_CTX,
                                   qk_scale, False, CAUSAL, HEAD_DIM, BLOCK_N, PRECISION, BLOCK_D)
    acc, l_i, m_i, n2 = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, skn, skd, svn, svd, offs_m, split, end, N_CTX,
                                   qk_scale, True, CAUSAL, HEAD_DIM, BLOCK_N, PRECISION, BLOCK_D)
    acc = acc / l_i[:, None]  # §3.1.1: one rescale at the end, not per block
    tl.store(LSE + hz.to(tl.int64) * N_CTX + offs_m, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=rows)
    o_ptrs = O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=tile)
    if COUNT_VISITS:
        tl.store(VISITS + hz * tl.num_programs(0) + pid, n1 + n2)


# --- autotuning (Hopper: H100/H200) and launching -----------------------------------------------

# "dkdvq": the dK/dV kernel with ATOMIC_DQ, autotuned on its own (it holds a dQ tile too)
_KERNELS = MappingProxyType({"fwd": _fwd_kernel, "dkdv": _bwd_dkdv_kernel, "dq": _bwd_dq_kernel,
                             "dkdvq": _bwd_dkdv_kernel})
if triton is not None:
    _KEY = ["N_CTX", "HEAD_DIM", "CAUSAL", "GROUP"]  # GROUP: a dK/dV program's work grows with it
    _TUNED = MappingProxyType({
        (kind, d): triton.autotune([triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
                                    for m, n, w, s in configs_for(kind, d)], key=_KEY,
                                   reset_to_zero=["DQ_ACC"] if kind == "dkdvq" else None)(fn)
        for kind, fn in _KERNELS.items() for d in (64, 128)})


def _launch(kind: str, s: int, bh: int, args: tuple, rest: tuple, flags: dict, blocks: tuple[int, int] | None,
            count_visits: bool) -> Tensor | None:
    """Launch one kernel: explicit blocks, else the interpreter's fixed ones, else autotuned (env read now).

    One program per query block (fwd, dq) of each (batch, head), or key block (dkdv, dkdvq) of each
    (batch, kv head): §3.2's sequence parallelism; ``bh`` counts those pairs. Kernel arguments are
    ``args``, the visit counts (when ``count_visits``; returned), ``rest``.
    """
    if blocks is None and _interpreting():
        blocks = INTERPRETER_BLOCKS[kind]
    held = 1 if kind in ("dkdv", "dkdvq") else 0  # the block a program holds: keys for dK/dV, else queries
    visits = None
    if count_visits:
        if blocks is None:
            raise ValueError("counting visited blocks needs explicit blocks=(BLOCK_M, BLOCK_N)")
        visits = torch.full((bh, triton.cdiv(s, blocks[held])), -1, dtype=torch.int32, device=args[0].device)
    flags, args = dict(flags, COUNT_VISITS=count_visits), (*args, visits if count_visits else args[0], *rest)
    if s == 0:
        return visits
    if blocks is None:
        name = ("BLOCK_M", "BLOCK_N")[held]
        tuned = _TUNED[kind, head_dim_class(flags["HEAD_DIM"])]
        tuned[lambda meta: (triton.cdiv(s, meta[name]), bh)](*args, **flags)
    else:
        grid = (triton.cdiv(s, blocks[held]), bh)
        _KERNELS[kind][grid](*args, **flags, BLOCK_M=blocks[0], BLOCK_N=blocks[1], num_warps=4, num_stages=2)
    return visits


def _empty_bshd(q: Tensor) -> Tensor:
    """(b, h, s, d) tensor stored as (b, s, h, d): the model transposes it back to (b, s, hidden) for free."""
    b, h, s, d = q.shape
    return torch.empty((b, s, h, d), dtype=q.dtype, device=q.device).transpose(1, 2)


def group_size(q: Tensor, k: Tensor) -> int:
    """Query heads per key/value head (GQA; 1: multi-head attention); a ValueError unless kv heads divide q heads."""
    h, kv_heads = q.shape[1], k.shape[1]
    if kv_heads < 1 or h % kv_heads:
        raise ValueError(f"grouped-query attention needs k/v heads dividing q's {h} heads, got {kv_heads}")
    return h // kv_heads


def _flags(q: Tensor, k: Tensor, causal: bool) -> dict:
    """fp32 inputs use IEEE dot products unless torch matmuls may use TF32 too (allow_tf32). GROUP (GQA) is a
    compile-time constant: one kernel per group size, and group 1 compiles exactly as multi-head attention."""
    tf32 = q.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    d = q.shape[-1]
    return dict(HEAD_DIM=d, BLOCK_D=block_d(d), CAUSAL=causal, PRECISION="tf32" if tf32 else "ieee",
                GROUP=group_size(q, k))


def flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, blocks: tuple[int, int] | None = None,
                  count_visits: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """(O, LSE (b, h, s) fp32 natural log, key blocks visited per query-block program or None).

    k, v: (b, kv_heads, s, d), kv_heads dividing h (GQA: read in place, never repeated)."""
    b, h, s, d = q.shape
    o, lse = _empty_bshd(q), torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    rest = (LOG2E / math.sqrt(d), *q.stride(), *k.stride(), *v.stride(), *o.stride(), h, s)
    visits = _launch("fwd", s, b * h, (q, k, v, o, lse), rest, _flags(q, k, causal), blocks, count_visits)
    return o, lse, visits


def flash_backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, causal: bool,
                   blocks: tuple[tuple[int, int], tuple[int, int] | None] | None = None, count_visits: bool = False,
                   dq_mode: str = "separate") -> tuple[Tensor, Tensor, Tensor, tuple | None]:
    """(dQ, dK, dV, (query blocks visited per dK/dV program, key blocks per dQ program or None) or None).

    GQA (k, v with fewer heads): dK, dV have k's heads, each the sum over its group's query heads, summed
    inside the dK/dV program (one per key block of each (batch, kv head); its visits count every query head).

    dq_mode: "separate" (a deterministic second pass) or "atomic" (added by the dK/dV programs; see
    ``kernels.flash_backward``). blocks: ((BLOCK_M, BLOCK_N) of the dK/dV pass, (BLOCK_M, BLOCK_N) of
    the dQ pass, None with "atomic").
    """
    if dq_mode not in DQ_MODES:
        raise ValueError(f"dq_mode must be one of {DQ_MODES}, got {dq_mode!r}")
    b, h, s, d = q.shape
    flags = _flags(q, k, causal)
    delta = torch.empty_like(lse)
    if s > 0:
        _bwd_delta_kernel[(triton.cdiv(s, 64), b * h)](o, do, delta, *o.stride(), *do.stride(), h, s,
                                                       HEAD_DIM=d, BLOCK_M=64, BLOCK_D=block_d(d))
    dk, dv = _empty_bshd(k), _empty_bshd(k)
    kv_blocks, q_blocks = blocks if blocks is not None else (None, None)
    scales = (1.0 / math.sqrt(d) * LOG2E, 1.0 / math.sqrt(d))
    strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride())
    kv_programs = b * k.shape[1]  # dK/dV: one per key block of each (batch, kv head)
    if dq_mode == "atomic":
        dq_acc = torch.zeros((b, h, s, d), dtype=torch.float32, device=q.device)
        rest = (*scales, *strides, *dq_acc.stride()[:3], h, s)
        kv_visits = _launch("dkdvq", s, kv_programs, (q, k, v, do, dk, dv, dq_acc, lse, delta), rest,
                            dict(flags, ATOMIC_DQ=True), kv_blocks, count_visits)
        return (dq_acc * scales[1]).to(q.dtype), dk, dv, (kv_visits, None) if count_visits else None
    dq = _empty_bshd(q)
    kv_visits = _launch("dkdv", s, kv_programs, (q, k, v, do, dk, dv, q, lse, delta),
                        (*scales, *strides, 0, 0, 0, h, s), dict(flags, ATOMIC_DQ=False), kv_blocks,
                        count_visits)  # q: an unused DQ_ACC
    q_strides = (*strides[:-4], *dq.stride())  # dQ's own (dK's has the kv heads)
    q_visits = _launch("dq", s, b * h, (q, k, v, do, dq, lse, delta), (*scales, *q_strides, h, s), flags,
                       q_blocks, count_visits)
    return dq, dk, dv, (kv_visits, q_visits) if count_visits else None


class FlashAttention(torch.autograd.Function):
    """Autograd over the Triton kernels: saves Q, K, V, O and the fp32 LSE, recomputes P (Dao 2023 §3.1.2)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, causal: bool, dq_mode: str = "separate") -> Tensor:
        o, lse, _ = flash_forward(q, k, v, causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.dq_mode = causal, dq_mode
        return o

    @staticmethod
    def backward(ctx, do: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv, _ = flash_backward(q, k, v, o, lse, do, ctx.causal, dq_mode=ctx.dq_mode)
        return dq, dk, dv, None, None

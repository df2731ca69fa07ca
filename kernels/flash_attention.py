"""FlashAttention-2 (Dao 2023, "FlashAttention-2: Faster Attention with Better
Parallelism and Work Partitioning") in Triton, behind ``kernels.attention``:

- forward (§3.1.1, Algorithm 1): one program per (query block, batch*head), an online
  softmax over key blocks with one rescale of the output at the end; the S x S scores
  never exist; it saves the per-row log-sum-exp L (fp32).
- backward (§3.1.2, Algorithm 2): delta = rowsum(dO * O); one program per key block
  walks the query blocks accumulating dK, dV in registers; a second pass per query block
  computes dQ instead of §3.2's atomic adds (deterministic). P is recomputed from Q, K, L.
- causal (§3.1.1, "Causal masking"): blocks entirely above the diagonal are skipped by
  the loop bounds; only diagonal (and ragged-end) blocks pay for a mask.
  :func:`forward_key_range` and :func:`backward_query_range` are those bounds in Python.

Head dims up to 128: a head dim that is not a power of two (80, 96, ...) is padded up to one in
registers, its extra lanes loaded as zero and never stored; powers of two compile exactly as
without the padding. Scores are kept in base 2 (the softmax scale folded with log2(e), every exponential an
``exp2``); accumulation is fp32 for every input dtype. q/k/v/dO are read through
their strides (the model's views of its fused qkv projection are not contiguous).

Under ``TRITON_INTERPRET=1`` (set before triton is first imported: ``triton.jit`` decides
at decoration time, for triton's own ``tl.sum`` too) the same kernels run on the CPU
interpreter with one small fixed block shape instead of autotuning.
"""

from __future__ import annotations

import math
import os
from types import MappingProxyType

from kernels.attention_configs import configs_for, head_dim_class

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # torch-only installs: impl="torch" still works; resolve_impl explains the rest
    triton = None
    tl = None

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 128  # any head dim up to this (larger ones: torch SDPA, see kernels.attention.resolve_impl)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Fixed (BLOCK_M, BLOCK_N) per kernel under the interpreter; uneven on purpose so the
# bound arithmetic for BLOCK_M != BLOCK_N is what the CPU tests exercise.
INTERPRETER_BLOCKS = MappingProxyType({"fwd": (32, 16), "dkdv": (16, 32), "dq": (32, 16)})


def _jit(fn):  # without triton the kernels stay plain (never called) functions
    return triton.jit(fn) if triton is not None else fn


def block_d(head_dim: int) -> int:
    """The power of two (at least 16, tl.dot's minimum) a head dim is padded to inside the kernels."""
    return max(16, 1 << (head_dim - 1).bit_length())


def supports_head_dim(head_dim: int) -> bool:
    return 1 <= head_dim <= MAX_HEAD_DIM


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# --- loop bounds (Python mirror of the @jit versions below) ------------------------------------


def forward_key_range(block: int, block_m: int, block_n: int, seq_len: int, causal: bool) -> tuple[int, int]:
    """Keys a query block (forward, dQ pass) visits: [0, split) unmasked, [split, end) masked.

    Causal: keys after the block's last row are never loaded. Non-causal: only the ragged end is masked."""
    if causal:
        return (block * block_m) // block_n * block_n, min((block + 1) * block_m, seq_len)
    return seq_len // block_n * block_n, seq_len


def backward_query_range(block: int, block_m: int, block_n: int, seq_len: int, causal: bool) -> tuple[int, int, int]:
    """Queries a key block (dK/dV pass) visits: [begin, split) causally masked, [split, end) unmasked.

    Causal: query rows before ``begin`` are skipped. Ragged rows load as 0 with L = +inf: they add 0."""
    if causal:
        start_n = block * block_n
        begin = start_n // block_m * block_m
        return begin, min(-(-(start_n + block_n) // block_m) * block_m, seq_len), seq_len
    return 0, 0, seq_len


@_jit
def _fwd_bounds(pid, N_CTX, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    split = (pid * BLOCK_M) // BLOCK_N * BLOCK_N if CAUSAL else N_CTX // BLOCK_N * BLOCK_N
    end = tl.minimum((pid + 1) * BLOCK_M, N_CTX) if CAUSAL else N_CTX
    return split, end


@_jit
def _lanes(offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Head-dim lanes that exist: a constant all-true mask (folded away: loads stay vectorised) unless the head
    dim was padded up to BLOCK_D, whose extra lanes load as 0 and are never stored."""
    if HEAD_DIM == BLOCK_D:
        return tl.full([BLOCK_D], 1, tl.int1)
    return offs_d < HEAD_DIM


@_jit
def _keep(offs_m, offs_n, N_CTX, CAUSAL: tl.constexpr):
    """Scores that exist: key inside the sequence and, causal, not after the query."""
    keep = offs_n[None, :] < N_CTX
    if CAUSAL:
        keep = keep & (offs_m[:, None] >= offs_n[None, :])
    return keep


# --- forward (Dao 2023 Algorithm 1) ------------------------------------------------------------


@_jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, skn, skd, svn, svd, offs_m, lo, hi, N_CTX, qk_scale,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
               PRECISION: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    lanes = _lanes(offs_d, HEAD_DIM, BLOCK_D)
    visits = 0
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        cols = offs_n < N_CTX  # row-constant masks keep the loads vectorised along head_dim
        kt = tl.load(k_base + offs_n[None, :] * skn + offs_d[:, None] * skd, mask=cols[None, :] & lanes[:, None],
                     other=0.0)
        v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=cols[:, None] & lanes[None, :],
                    other=0.0)
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
                HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                COUNT_VISITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """O and L for one query block (Algorithm 1; §3.2: one program per block, no cross-block sync)."""
    pid, hz = tl.program_id(0), tl.program_id(1)
    b, h = (hz // H).to(tl.int64), (hz % H).to(tl.int64)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = offs_m < N_CTX
    tile = rows[:, None] & _lanes(offs_d, HEAD_DIM, BLOCK_D)[None, :]
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=tile, other=0.0)
    k_base, v_base = K + b * skb + h * skh, V + b * svb + h * svh
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


# --- backward (Dao 2023 Algorithm 2) -----------------------------------------------------------


@_jit
def _bwd_delta_kernel(O, DO, DELTA, sob, soh, som, sod, sdb, sdh, sdm, sdd, H, N_CTX,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """delta = rowsum(dO * O) (Algorithm 2): the P^T dP term of dS, once per row."""
    hz = tl.program_id(1)
    b, h = (hz // H).to(tl.int64), (hz % H).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = offs_m < N_CTX
    tile = rows[:, None] & _lanes(offs_d, HEAD_DIM, BLOCK_D)[None, :]
    o = tl.load(O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod, mask=tile, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :] * sdd, mask=tile, other=0.0)
    tl.store(DELTA + hz.to(tl.int64) * N_CTX + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=rows)


@_jit
def _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqm, sqd, sdm, sdd, offs_n, lo, hi,
                    N_CTX, qk_scale, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    PRECISION: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    lanes = _lanes(offs_d, HEAD_DIM, BLOCK_D)
    visits = 0
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        rows = offs_m < N_CTX
        qt = tl.load(q_base + offs_m[None, :] * sqm + offs_d[:, None] * sqd, mask=rows[None, :] & lanes[:, None],
                     other=0.0)
        do = tl.load(do_base + offs_m[:, None] * sdm + offs_d[None, :] * sdd, mask=rows[:, None] & lanes[None, :],
                     other=0.0)
        lse = tl.load(lse_base + offs_m, mask=rows, other=float("inf"))  # +inf: padded rows get P = 0
        delta = tl.load(delta_base + offs_m, mask=rows, other=0.0)
        pt = tl.math.exp2(tl.dot(k, qt, input_precision=PRECISION) * qk_scale - lse[None, :] * 1.4426950408889634)
        if MASKED:
            pt = tl.where(offs_m[None, :] >= offs_n[:, None], pt, 0.0)
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dst = pt * (dpt - delta[None, :])
        dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk, input_precision=PRECISION)
        visits += 1
    return dk, dv, visits


@_jit
def _bwd_dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, VISITS, qk_scale, sm_scale,
                     sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdm, sdd,
                     sgb, sgh, sgm, sgd, H, N_CTX, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                     PRECISION: tl.constexpr, COUNT_VISITS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """dK, dV of one key block, over its query blocks (Algorithm 2's outer loop; §3.2 parallel over keys)."""
    pid, hz = tl.program_id(0), tl.program_id(1)
    b, h = (hz // H).to(tl.int64), (hz % H).to(tl.int64)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    cols = offs_n < N_CTX
    tile = cols[:, None] & _lanes(offs_d, HEAD_DIM, BLOCK_D)[None, :]
    k = tl.load(K + b * skb + h * skh + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=tile, other=0.0)
    v = tl.load(V + b * svb + h * svh + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=tile, other=0.0)
    q_base, do_base = Q + b * sqb + h * sqh, DO + b * sdb + h * sdh
    lse_base, delta_base = LSE + hz.to(tl.int64) * N_CTX, DELTA + hz.to(tl.int64) * N_CTX
    dk, dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32), tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    begin = (pid * BLOCK_N) // BLOCK_M * BLOCK_M if CAUSAL else 0
    split = tl.minimum(tl.cdiv(pid * BLOCK_N + BLOCK_N, BLOCK_M) * BLOCK_M, N_CTX) if CAUSAL else 0
    dk, dv, n1 = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqm, sqd, sdm, sdd, offs_n,
                                 begin, split, N_CTX, qk_scale, True, HEAD_DIM, BLOCK_M, PRECISION, BLOCK_D)
    dk, dv, n2 = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqm, sqd, sdm, sdd, offs_n,
                                 split, N_CTX, N_CTX, qk_scale, False, HEAD_DIM, BLOCK_M, PRECISION, BLOCK_D)
    g = b * sgb + h * sgh + offs_n[:, None] * sgm + offs_d[None, :] * sgd
    tl.store(DK + g, (dk * sm_scale).to(DK.dtype.element_ty), mask=tile)
    tl.store(DV + g, dv.to(DV.dtype.element_ty), mask=tile)
    if COUNT_VISITS:
        tl.store(VISITS + hz * tl.num_programs(0) + pid, n1 + n2)


@_jit
def _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, skn, skd, svn, svd, offs_m, lo, hi, N_CTX, qk_scale,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                  PRECISION: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    lanes = _lanes(offs_d, HEAD_DIM, BLOCK_D)
    visits = 0
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        cols = (offs_n[None, :] < N_CTX) & lanes[:, None]
        kt = tl.load(k_base + offs_n[None, :] * skn + offs_d[:, None] * skd, mask=cols, other=0.0)
        vt = tl.load(v_base + offs_n[None, :] * svn + offs_d[:, None] * svd, mask=cols, other=0.0)
        p = tl.math.exp2(tl.dot(q, kt, input_precision=PRECISION) * qk_scale - lse[:, None])
        if MASKED:
            p = tl.where(_keep(offs_m, offs_n, N_CTX, CAUSAL), p, 0.0)
        ds = p * (tl.dot(do, vt, input_precision=PRECISION) - delta[:, None])
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=PRECISION)
        visits += 1
    return dq, visits


@_jit
def _bwd_dq_kernel(Q, K, V, DO, DQ, LSE, DELTA, VISITS, qk_scale, sm_scale,
                   sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdm, sdd,
                   sgb, sgh, sgm, sgd, H, N_CTX, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                   PRECISION: tl.constexpr, COUNT_VISITS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """dQ of one query block: a second pass in place of Algorithm 2's atomic adds (§3.2), so deterministic."""
    pid, hz = tl.program_id(0), tl.program_id(1)
    b, h = (hz // H).to(tl.int64), (hz % H).to(tl.int64)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = offs_m < N_CTX
    tile = rows[:, None] & _lanes(offs_d, HEAD_DIM, BLOCK_D)[None, :]
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=tile, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :] * sdd, mask=tile, other=0.0)
    lse = tl.load(LSE + hz.to(tl.int64) * N_CTX + offs_m, mask=rows, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + hz.to(tl.int64) * N_CTX + offs_m, mask=rows, other=0.0)
    k_base, v_base = K + b * skb + h * skh, V + b * svb + h * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    split, end = _fwd_bounds(pid, N_CTX, CAUSAL, BLOCK_M, BLOCK_N)
    dq, n1 = _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, skn, skd, svn, svd, offs_m, 0, split, N_CTX,
                           qk_scale, False, CAUSAL, HEAD_DIM, BLOCK_N, PRECISION, BLOCK_D)
    dq, n2 = _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, skn, skd, svn, svd, offs_m, split, end, N_CTX,
                           qk_scale, True, CAUSAL, HEAD_DIM, BLOCK_N, PRECISION, BLOCK_D)
    g = b * sgb + h * sgh + offs_m[:, None] * sgm + offs_d[None, :] * sgd
    tl.store(DQ + g, (dq * sm_scale).to(DQ.dtype.element_ty), mask=tile)
    if COUNT_VISITS:
        tl.store(VISITS + hz * tl.num_programs(0) + pid, n1 + n2)


# --- autotuning (Hopper: H100/H200) and launching -----------------------------------------------

_KERNELS = MappingProxyType({"fwd": _fwd_kernel, "dkdv": _bwd_dkdv_kernel, "dq": _bwd_dq_kernel})
if triton is not None:
    _KEY = ["N_CTX", "HEAD_DIM", "CAUSAL"]
    _TUNED = MappingProxyType({
        (kind, d): triton.autotune([triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
                                    for m, n, w, s in configs_for(kind, d)], key=_KEY)(fn)
        for kind, fn in _KERNELS.items() for d in (64, 128)})


def _launch(kind: str, s: int, bh: int, args: tuple, rest: tuple, flags: dict, blocks: tuple[int, int] | None,
            count_visits: bool) -> Tensor | None:
    """Launch one kernel: explicit blocks, else the interpreter's fixed ones, else autotuned (env read now).

    One program per query block (fwd, dq) or key block (dkdv) of each (batch, head): §3.2's
    sequence parallelism. Kernel arguments are ``args``, the visit counts (when
    ``count_visits``; returned), ``rest``.
    """
    if blocks is None and _interpreting():
        blocks = INTERPRETER_BLOCKS[kind]
    held = 1 if kind == "dkdv" else 0  # the block a program holds: keys for dkdv, queries otherwise
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


def _flags(q: Tensor, causal: bool) -> dict:
    """fp32 inputs use IEEE dot products unless torch matmuls may use TF32 too (allow_tf32)."""
    tf32 = q.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    d = q.shape[-1]
    return dict(HEAD_DIM=d, BLOCK_D=block_d(d), CAUSAL=causal, PRECISION="tf32" if tf32 else "ieee")


def flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, blocks: tuple[int, int] | None = None,
                  count_visits: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """(O, LSE (b, h, s) fp32 natural log, key blocks visited per query-block program or None)."""
    b, h, s, d = q.shape
    o, lse = _empty_bshd(q), torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    rest = (LOG2E / math.sqrt(d), *q.stride(), *k.stride(), *v.stride(), *o.stride(), h, s)
    visits = _launch("fwd", s, b * h, (q, k, v, o, lse), rest, _flags(q, causal), blocks, count_visits)
    return o, lse, visits


def flash_backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, causal: bool,
                   blocks: tuple[tuple[int, int], tuple[int, int]] | None = None, count_visits: bool = False,
                   ) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, Tensor] | None]:
    """(dQ, dK, dV, (query blocks visited per dK/dV program, key blocks per dQ program) or None).

    blocks: ((BLOCK_M, BLOCK_N) of the dK/dV pass, (BLOCK_M, BLOCK_N) of the dQ pass).
    """
    b, h, s, d = q.shape
    delta = torch.empty_like(lse)
    if s > 0:
        _bwd_delta_kernel[(triton.cdiv(s, 64), b * h)](o, do, delta, *o.stride(), *do.stride(), h, s,
                                                       HEAD_DIM=d, BLOCK_M=64, BLOCK_D=block_d(d))
    dq, dk, dv = _empty_bshd(q), _empty_bshd(q), _empty_bshd(q)
    kv_blocks, q_blocks = blocks if blocks is not None else (None, None)
    rest = (1.0 / math.sqrt(d) * LOG2E, 1.0 / math.sqrt(d),
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), h, s)
    flags = _flags(q, causal)
    kv_visits = _launch("dkdv", s, b * h, (q, k, v, do, dk, dv, lse, delta), rest, flags, kv_blocks, count_visits)
    q_visits = _launch("dq", s, b * h, (q, k, v, do, dq, lse, delta), rest, flags, q_blocks, count_visits)
    return dq, dk, dv, (kv_visits, q_visits) if count_visits else None


class FlashAttention(torch.autograd.Function):
    """Autograd over the Triton kernels: saves Q, K, V, O and the fp32 LSE, recomputes P (Dao 2023 §3.1.2)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
        o, lse, _ = flash_forward(q, k, v, causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        return o

    @staticmethod
    def backward(ctx, do: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv, _ = flash_backward(q, k, v, o, lse, do, ctx.causal)
        return dq, dk, dv, None

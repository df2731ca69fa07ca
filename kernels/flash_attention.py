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

from megazero.kernels.attention_configs import configs_for, head_dim_class
from megazero.kernels.flash_backward import _bwd_delta_kernel, _bwd_dkdv_kernel, _bwd_dq_kernel
from megazero.kernels.flash_blocks import (LOG2E, _block_tile, _fwd_bounds, _interpreting, _jit, _keep, _key_block,
                                   _query_key_runs, block_d, tl, triton)

# Fixed (BLOCK_M, BLOCK_N) per kernel under the interpreter; uneven on purpose so the
# bound arithmetic for BLOCK_M != BLOCK_N is what the CPU tests exercise.
INTERPRETER_BLOCKS = MappingProxyType({"fwd": (32, 16), "dkdv": (16, 32), "dq": (32, 16), "dkdvq": (16, 32)})
DQ_MODES = ("separate", "atomic")



# --- forward (Dao 2023 Algorithm 1) ------------------------------------------------------------


@_jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, skn, skd, svn, svd, offs_m, lo, hi, N_CTX, qk_scale, q_ids, kd_base,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
               PRECISION: tl.constexpr, BLOCK_D: tl.constexpr, DOCS: tl.constexpr):
    """Key blocks [lo, hi) into the online softmax. DOCS: keys of another document score -inf, and a row that has
    seen no key yet (max still -inf) takes 0 as its running max so that exp2 gives 0, not NaN (-inf - -inf)."""
    visits = 0
    for start_n in range(lo, hi, BLOCK_N):
        offs_n, kt, v = _key_block(k_base, v_base, skn, skd, svn, svd, start_n, N_CTX, HEAD_DIM, BLOCK_N, BLOCK_D,
                                   False)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # log2-domain scores, fp32
        if MASKED:
            s = tl.where(_keep(offs_m, offs_n, N_CTX, CAUSAL), s, float("-inf"))
        if DOCS:
            k_ids = tl.load(kd_base + offs_n, mask=offs_n < N_CTX, other=-2)
            s = tl.where(q_ids[:, None] == k_ids[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: the first block visited always holds key 0
            m_use = m_new
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
        visits += 1
    return acc, l_i, m_i, visits


@_jit
def _fwd_kernel(Q, K, V, O, LSE, VISITS, QD, KD, qk_scale,
                sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod, H, N_CTX,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                COUNT_VISITS: tl.constexpr, DOCS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """O and L for one query block (Algorithm 1; §3.2: one program per block, no cross-block sync).

    GQA: query head h reads key/value head h // GROUP in place (GROUP = 1: multi-head attention).
    DOCS: QD, KD are (batch, N_CTX) int32 document ids, non-decreasing; only the contiguous run of key blocks
    sharing a document with this query block is visited (``flash_blocks._doc_tiles``). A row that sees no key
    at all gets O = 0 and L = -inf (possible in a ring attention block)."""
    pid, hz = tl.program_id(0), tl.program_id(1)
    b, h = (hz // H).to(tl.int64), (hz % H).to(tl.int64)
    hk = h // GROUP
    offs_m, offs_d, rows, tile = _block_tile(pid, N_CTX, BLOCK_M, HEAD_DIM, BLOCK_D)
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=tile, other=0.0)
    k_base, v_base = K + b * skb + hk * skh, V + b * svb + hk * svh
    m_i, l_i = tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    split, end = _fwd_bounds(pid, N_CTX, CAUSAL, BLOCK_M, BLOCK_N)
    kd_base, q_ids, lo1, hi1, lo2, hi2 = _query_key_runs(QD, KD, b, pid, offs_m, rows, split, end, N_CTX, BLOCK_M,
                                                         BLOCK_N, DOCS)
    acc, l_i, m_i, n1 = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, skn, skd, svn, svd, offs_m, lo1, hi1, N_CTX,
                                   qk_scale, q_ids, kd_base, False, CAUSAL, HEAD_DIM, BLOCK_N, PRECISION, BLOCK_D,
                                   DOCS)
    acc, l_i, m_i, n2 = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, skn, skd, svn, svd, offs_m, lo2, hi2, N_CTX,
                                   qk_scale, q_ids, kd_base, True, CAUSAL, HEAD_DIM, BLOCK_N, PRECISION, BLOCK_D,
                                   DOCS)
    if DOCS:  # nothing visible: l = 0, so O = 0 (acc is 0) rather than 0 / 0, and L = -inf (m is -inf)
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
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
    _KEY = ["N_CTX", "HEAD_DIM", "CAUSAL", "GROUP", "DOCS"]  # GROUP: a dK/dV program's work grows with it
    _TUNED = MappingProxyType({  # the document-masked variants have their own sets (attention_configs.DOC_SPILLS)
        (kind, d, docs): triton.autotune([triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
                                          for m, n, w, s in configs_for(kind, d, docs)], key=_KEY,
                                         reset_to_zero=["DQ_ACC"] if kind == "dkdvq" else None)(fn)
        for kind, fn in _KERNELS.items() for d in (64, 128) for docs in (False, True)})


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
        tuned = _TUNED[kind, head_dim_class(flags["HEAD_DIM"]), bool(flags["DOCS"])]
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


def _flags(q: Tensor, k: Tensor, causal: bool, docs: bool = False) -> dict:
    """fp32 inputs use IEEE dot products unless torch matmuls may use TF32 too (allow_tf32). GROUP (GQA) is a
    compile-time constant: one kernel per group size, and group 1 compiles exactly as multi-head attention.
    DOCS (document mask) too: without one the kernels compile exactly as before it existed."""
    tf32 = q.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    d = q.shape[-1]
    return dict(HEAD_DIM=d, BLOCK_D=block_d(d), CAUSAL=causal, PRECISION="tf32" if tf32 else "ieee",
                GROUP=group_size(q, k), DOCS=docs)


def _doc_ids(q: Tensor, q_doc: Tensor | None, k_doc: Tensor | None) -> tuple[Tensor, Tensor] | None:
    """The (batch, seq) document ids as the kernels read them (int32, contiguous, on q's device), or None.

    Not checked to be non-decreasing (that would cost a host sync per call): a decreasing run makes the tile
    skipping drop visible keys."""
    if q_doc is None and k_doc is None:
        return None
    if q_doc is None or k_doc is None:
        raise ValueError("document masks need both q_doc and k_doc (or neither)")
    want = (q.shape[0], q.shape[2])
    for name, ids in (("q_doc", q_doc), ("k_doc", k_doc)):
        if tuple(ids.shape) != want or ids.dtype.is_floating_point or ids.dtype.is_complex:
            raise ValueError(f"{name} must be integer document ids of shape (batch, seq) = {want}, got "
                             f"{tuple(ids.shape)} {ids.dtype}")
    return tuple(x.to(device=q.device, dtype=torch.int32).contiguous() for x in (q_doc, k_doc))


def flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, blocks: tuple[int, int] | None = None,
                  count_visits: bool = False, q_doc: Tensor | None = None,
                  k_doc: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """(O, LSE (b, h, s) fp32 natural log, key blocks visited per query-block program or None).

    k, v: (b, kv_heads, s, d), kv_heads dividing h (GQA: read in place, never repeated).
    q_doc, k_doc: (b, s) int document ids, non-decreasing along s; query i sees key j only when
    q_doc[b, i] == k_doc[b, j] (and j <= i when causal). Key blocks of no shared document are skipped, not
    loaded. A row that sees no key (a ring block) gets O = 0 and LSE = -inf. None: no document mask."""
    b, h, s, d = q.shape
    docs = _doc_ids(q, q_doc, k_doc)
    o, lse = _empty_bshd(q), torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    ids = docs if docs is not None else (q, q)  # unused pointers without DOCS
    rest = (*ids, LOG2E / math.sqrt(d), *q.stride(), *k.stride(), *v.stride(), *o.stride(), h, s)
    visits = _launch("fwd", s, b * h, (q, k, v, o, lse), rest, _flags(q, k, causal, docs is not None), blocks,
                     count_visits)
    return o, lse, visits


def flash_backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, causal: bool,
                   blocks: tuple[tuple[int, int], tuple[int, int] | None] | None = None, count_visits: bool = False,
                   dq_mode: str = "separate", q_doc: Tensor | None = None,
                   k_doc: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, tuple | None]:
    """(dQ, dK, dV, (query blocks visited per dK/dV program, key blocks per dQ program or None) or None).

    GQA (k, v with fewer heads): dK, dV have k's heads, each the sum over its group's query heads, summed
    inside the dK/dV program (one per key block of each (batch, kv head); its visits count every query head).

    dq_mode: "separate" (a deterministic second pass) or "atomic" (added by the dK/dV programs; see
    ``kernels.flash_backward``). blocks: ((BLOCK_M, BLOCK_N) of the dK/dV pass, (BLOCK_M, BLOCK_N) of
    the dQ pass, None with "atomic"). q_doc, k_doc: the document mask of :func:`flash_forward`, skipping the
    same blocks; rows with LSE = -inf (nothing visible) get zero gradients.
    """
    if dq_mode not in DQ_MODES:
        raise ValueError(f"dq_mode must be one of {DQ_MODES}, got {dq_mode!r}")
    b, h, s, d = q.shape
    docs = _doc_ids(q, q_doc, k_doc)
    flags = _flags(q, k, causal, docs is not None)
    ids = docs if docs is not None else (q, q)  # unused pointers without DOCS
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
        rest = (*ids, *scales, *strides, *dq_acc.stride()[:3], h, s)
        kv_visits = _launch("dkdvq", s, kv_programs, (q, k, v, do, dk, dv, dq_acc, lse, delta), rest,
                            dict(flags, ATOMIC_DQ=True), kv_blocks, count_visits)
        return (dq_acc * scales[1]).to(q.dtype), dk, dv, (kv_visits, None) if count_visits else None
    dq = _empty_bshd(q)
    kv_visits = _launch("dkdv", s, kv_programs, (q, k, v, do, dk, dv, q, lse, delta),
                        (*ids, *scales, *strides, 0, 0, 0, h, s), dict(flags, ATOMIC_DQ=False), kv_blocks,
                        count_visits)  # q: an unused DQ_ACC
    q_strides = (*strides[:-4], *dq.stride())  # dQ's own (dK's has the kv heads)
    q_visits = _launch("dq", s, b * h, (q, k, v, do, dq, lse, delta), (*ids, *scales, *q_strides, h, s), flags,
                       q_blocks, count_visits)
    return dq, dk, dv, (kv_visits, q_visits) if count_visits else None


class FlashAttention(torch.autograd.Function):
    """Autograd over the Triton kernels: saves Q, K, V, O and the fp32 LSE, recomputes P (Dao 2023 §3.1.2).

    q_doc, k_doc: optional (batch, seq) document ids (see :func:`flash_forward`); no gradient."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, causal: bool, dq_mode: str = "separate",
                q_doc: Tensor | None = None, k_doc: Tensor | None = None) -> Tensor:
        o, lse, _ = flash_forward(q, k, v, causal, q_doc=q_doc, k_doc=k_doc)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.dq_mode, ctx.docs = causal, dq_mode, (q_doc, k_doc)
        return o

    @staticmethod
    def backward(ctx, do: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None, None, None]:
        q, k, v, o, lse = ctx.saved_tensors
        q_doc, k_doc = ctx.docs
        dq, dk, dv, _ = flash_backward(q, k, v, o, lse, do, ctx.causal, dq_mode=ctx.dq_mode, q_doc=q_doc,
                                       k_doc=k_doc)
        return dq, dk, dv, None, None, None, None

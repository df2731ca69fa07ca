"""FlashAttention-2 backward kernels (Dao 2023, Algorithm 2), launched by ``kernels.flash_attention``.

delta = rowsum(dO * O) first (the P^T dP term of dS, once per row). Then one program per key
block walks the query blocks, recomputing P from Q, K and the saved log-sum-exp, and accumulates
dK, dV in registers (§3.2: parallel over keys). Grouped-query attention (Ainslie et al. 2023,
"GQA: Training Generalized Multi-Query Transformer Models from Multi-Head Checkpoints"): a key
block's program belongs to one key/value head and walks the query blocks of every query head of its
group, so the group's sum of dK, dV stays in its registers, is written once, and needs no atomics
nor a per-query-head copy to reduce. dQ comes one of two ways:

- "separate" (the default): a second pass, one program per query block over its key blocks.
  Deterministic, at the price of recomputing Q K^T and dO V^T: 7 matrix products per block pair.
- "atomic" (§3.2 as published): the key-block program also adds its share of dQ into an fp32
  buffer with atomic adds: 5 products per pair, but the summation order (and so the last bits of
  dQ) varies from run to run on a GPU.

Document masks (DOCS): each program visits only the contiguous run of blocks of the other side that share a
document with its own (``flash_blocks._doc_tiles``) and masks P by id equality inside it (a select, so the
exp2(s - L) = inf of a row with L = -inf, one that saw no key in the forward, never reaches a product: its P
and its gradients are 0).
"""
from __future__ import annotations

from megazero.kernels.flash_blocks import (DOC_SCAN, _block_tile, _doc_edges, _doc_tiles, _fwd_bounds, _jit, _keep, _key_block,
                                   _lanes, _query_key_runs, tl)

@_jit
def _bwd_delta_kernel(O, DO, DELTA, sob, soh, som, sod, sdb, sdh, sdm, sdd, H, N_CTX,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """delta = rowsum(dO * O) (Algorithm 2): the P^T dP term of dS, once per row."""
    hz = tl.program_id(1)
    b, h = (hz // H).to(tl.int64), (hz % H).to(tl.int64)
    offs_m, offs_d, rows, tile = _block_tile(tl.program_id(0), N_CTX, BLOCK_M, HEAD_DIM, BLOCK_D)
    o = tl.load(O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod, mask=tile, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :] * sdd, mask=tile, other=0.0)
    tl.store(DELTA + hz.to(tl.int64) * N_CTX + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=rows)


@_jit
def _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base, sqh, sqm, sqd, sdh, sdm, sdd, sah,
                    sam, offs_n, lo, hi, N_CTX, qk_scale, qd_base, k_ids, MASKED: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr, BLOCK_D: tl.constexpr,
                    ATOMIC_DQ: tl.constexpr, GROUP: tl.constexpr, DOCS: tl.constexpr):
    """The query blocks in [lo, hi) of each of the GROUP query heads from q_base (rows of LSE/DELTA N_CTX apart).

    GQA: one loop over (head, block) pairs, the head changing every ceil((hi - lo) / BLOCK_M) blocks, rather
    than a loop over heads around the masked and unmasked passes: compiled for sm_90 (``kernels.aot``), that
    nesting spilled registers (up to ~300 B per thread) in most autotune configurations; this loop keeps the
    registers of multi-head attention. GROUP = 1 is the plain block loop, the code as before GQA."""
    offs_d = tl.arange(0, BLOCK_D)
    lanes = _lanes(offs_d, HEAD_DIM, BLOCK_D)
    visits = 0
    if GROUP == 1:
        end = hi
    else:
        span = tl.cdiv(hi - lo, BLOCK_M) * BLOCK_M  # one head's pass, in whole blocks
        end = lo + GROUP * span
    for start in range(lo, end, BLOCK_M):
        if GROUP == 1:
            start_m, q_h, do_h, lse_h, delta_h, dq_h = start, q_base, do_base, lse_base, delta_base, dq_base
        else:
            g = (start - lo) // span  # the group's query head this block belongs to
            start_m = start - g * span
            q_h, do_h, dq_h = q_base + g * sqh, do_base + g * sdh, dq_base + g * sah
            lse_h, delta_h = lse_base + g * N_CTX, delta_base + g * N_CTX
        offs_m = start_m + tl.arange(0, BLOCK_M)
        rows = offs_m < N_CTX
        qt = tl.load(q_h + offs_m[None, :] * sqm + offs_d[:, None] * sqd, mask=rows[None, :] & lanes[:, None],
                     other=0.0)
        do = tl.load(do_h + offs_m[:, None] * sdm + offs_d[None, :] * sdd, mask=rows[:, None] & lanes[None, :],
                     other=0.0)
        lse = tl.load(lse_h + offs_m, mask=rows, other=float("inf"))  # +inf: padded rows get P = 0
        delta = tl.load(delta_h + offs_m, mask=rows, other=0.0)
        pt = tl.math.exp2(tl.dot(k, qt, input_precision=PRECISION) * qk_scale - lse[None, :] * 1.4426950408889634)
        if MASKED:
            pt = tl.where(offs_m[None, :] >= offs_n[:, None], pt, 0.0)
        if DOCS:
            q_ids = tl.load(qd_base + offs_m, mask=rows, other=-1)
            pt = tl.where(k_ids[:, None] == q_ids[None, :], pt, 0.0)
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dst = pt * (dpt - delta[None, :])
        dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk, input_precision=PRECISION)
        if ATOMIC_DQ:  # this key block's share of the rows' dQ, added into the fp32 buffer
            dq = tl.dot(tl.trans(dst.to(k.dtype)), k, input_precision=PRECISION)
            tl.atomic_add(dq_h + offs_m[:, None] * sam + offs_d[None, :], dq, mask=rows[:, None] & lanes[None, :])
        visits += 1
    return dk, dv, visits


@_jit
def _bwd_dkdv_kernel(Q, K, V, DO, DK, DV, DQ_ACC, LSE, DELTA, VISITS, QD, KD, qk_scale, sm_scale,
                     sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdm, sdd,
                     sgb, sgh, sgm, sgd, sab, sah, sam, H, N_CTX, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                     CAUSAL: tl.constexpr, PRECISION: tl.constexpr, COUNT_VISITS: tl.constexpr,
                     ATOMIC_DQ: tl.constexpr, DOCS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    """dK, dV of one key block, over its query blocks (Algorithm 2's outer loop; §3.2 parallel over keys).

    GQA: the program holds a block of key/value head hk, and its loops walk the query blocks of each query
    head hk * GROUP .. hk * GROUP + GROUP - 1 that reads it, summing their dK, dV in the same registers:
    written once, in a fixed order, no atomics (GROUP = 1: multi-head attention, the code as without GQA).
    DK, DV (strides sgb..sgd) have the key/value heads.
    ATOMIC_DQ: also add the block's share of dQ into DQ_ACC (fp32, (b, h, s, head_dim) with strides
    sab, sah, sam), so no dQ pass is needed; otherwise DQ_ACC and its strides are unused.
    DOCS: QD, KD (batch, N_CTX) int32 document ids; only the query blocks sharing a document are walked."""
    pid, hz = tl.program_id(0), tl.program_id(1)  # hz: (batch, kv head)
    b, hk = (hz // (H // GROUP)).to(tl.int64), (hz % (H // GROUP)).to(tl.int64)
    offs_n, offs_d, cols, tile = _block_tile(pid, N_CTX, BLOCK_N, HEAD_DIM, BLOCK_D)
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=tile, other=0.0)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=tile, other=0.0)
    h = hk * GROUP  # the group's first query head; its LSE/DELTA row (b * H + h) is hz * GROUP
    q_base, do_base, dq_base = Q + b * sqb + h * sqh, DO + b * sdb + h * sdh, DQ_ACC + b * sab + h * sah
    row = (hz * GROUP).to(tl.int64) * N_CTX
    lse_base, delta_base = LSE + row, DELTA + row
    dk, dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32), tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    begin = (pid * BLOCK_N) // BLOCK_M * BLOCK_M if CAUSAL else 0
    split = tl.minimum(tl.cdiv(pid * BLOCK_N + BLOCK_N, BLOCK_M) * BLOCK_M, N_CTX) if CAUSAL else 0
    if DOCS:
        qd_base, kd_base = QD + b * N_CTX, KD + b * N_CTX
        k_ids = tl.load(kd_base + offs_n, mask=cols, other=-2)
        first, last = _doc_edges(kd_base, pid * BLOCK_N, N_CTX, BLOCK_N)
        lo, hi = _doc_tiles(qd_base, first, last, begin, N_CTX, N_CTX, BLOCK_M, DOC_SCAN)
        lo1, hi1 = lo, tl.maximum(tl.minimum(hi, split), lo)
        lo2 = tl.maximum(lo, split)
        hi2 = tl.maximum(hi, lo2)
    else:
        qd_base, k_ids = QD, offs_n  # unused
        lo1, hi1, lo2, hi2 = begin, split, split, N_CTX
    dk, dv, n1 = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base, sqh, sqm, sqd, sdh,
                                 sdm, sdd, sah, sam, offs_n, lo1, hi1, N_CTX, qk_scale, qd_base, k_ids, True, HEAD_DIM,
                                 BLOCK_M, PRECISION, BLOCK_D, ATOMIC_DQ, GROUP, DOCS)
    dk, dv, n2 = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base, sqh, sqm, sqd, sdh,
                                 sdm, sdd, sah, sam, offs_n, lo2, hi2, N_CTX, qk_scale, qd_base, k_ids, False,
                                 HEAD_DIM, BLOCK_M, PRECISION, BLOCK_D, ATOMIC_DQ, GROUP, DOCS)
    g = b * sgb + hk * sgh + offs_n[:, None] * sgm + offs_d[None, :] * sgd
    tl.store(DK + g, (dk * sm_scale).to(DK.dtype.element_ty), mask=tile)
    tl.store(DV + g, dv.to(DV.dtype.element_ty), mask=tile)
    if COUNT_VISITS:
        tl.store(VISITS + hz * tl.num_programs(0) + pid, n1 + n2)


@_jit
def _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, skn, skd, svn, svd, offs_m, lo, hi, N_CTX, qk_scale,
                  q_ids, kd_base, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, BLOCK_D: tl.constexpr, DOCS: tl.constexpr):
    visits = 0
    for start_n in range(lo, hi, BLOCK_N):
        offs_n, kt, vt = _key_block(k_base, v_base, skn, skd, svn, svd, start_n, N_CTX, HEAD_DIM, BLOCK_N, BLOCK_D,
                                    True)
        p = tl.math.exp2(tl.dot(q, kt, input_precision=PRECISION) * qk_scale - lse[:, None])
        if MASKED:
            p = tl.where(_keep(offs_m, offs_n, N_CTX, CAUSAL), p, 0.0)
        if DOCS:
            k_ids = tl.load(kd_base + offs_n, mask=offs_n < N_CTX, other=-2)
            p = tl.where(q_ids[:, None] == k_ids[None, :], p, 0.0)
        ds = p * (tl.dot(do, vt, input_precision=PRECISION) - delta[:, None])
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=PRECISION)
        visits += 1
    return dq, visits


@_jit
def _bwd_dq_kernel(Q, K, V, DO, DQ, LSE, DELTA, VISITS, QD, KD, qk_scale, sm_scale,
                   sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdm, sdd,
                   sgb, sgh, sgm, sgd, H, N_CTX, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   CAUSAL: tl.constexpr, PRECISION: tl.constexpr, COUNT_VISITS: tl.constexpr, DOCS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """dQ of one query block: a second pass in place of Algorithm 2's atomic adds (§3.2), so deterministic.

    GQA: query head h reads key/value head h // GROUP in place. DOCS: the forward's key-block run."""
    pid, hz = tl.program_id(0), tl.program_id(1)
    b, h = (hz // H).to(tl.int64), (hz % H).to(tl.int64)
    hk = h // GROUP
    offs_m, offs_d, rows, tile = _block_tile(pid, N_CTX, BLOCK_M, HEAD_DIM, BLOCK_D)
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=tile, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :] * sdd, mask=tile, other=0.0)
    lse = tl.load(LSE + hz.to(tl.int64) * N_CTX + offs_m, mask=rows, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + hz.to(tl.int64) * N_CTX + offs_m, mask=rows, other=0.0)
    k_base, v_base = K + b * skb + hk * skh, V + b * svb + hk * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    split, end = _fwd_bounds(pid, N_CTX, CAUSAL, BLOCK_M, BLOCK_N)
    kd_base, q_ids, lo1, hi1, lo2, hi2 = _query_key_runs(QD, KD, b, pid, offs_m, rows, split, end, N_CTX, BLOCK_M,
                                                         BLOCK_N, DOCS)
    dq, n1 = _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, skn, skd, svn, svd, offs_m, lo1, hi1, N_CTX,
                           qk_scale, q_ids, kd_base, False, CAUSAL, HEAD_DIM, BLOCK_N, PRECISION, BLOCK_D, DOCS)
    dq, n2 = _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, skn, skd, svn, svd, offs_m, lo2, hi2, N_CTX,
                           qk_scale, q_ids, kd_base, True, CAUSAL, HEAD_DIM, BLOCK_N, PRECISION, BLOCK_D, DOCS)
    g = b * sgb + h * sgh + offs_m[:, None] * sgm + offs_d[None, :] * sgd
    tl.store(DQ + g, (dq * sm_scale).to(DQ.dtype.element_ty), mask=tile)
    if COUNT_VISITS:
        tl.store(VISITS + hz * tl.num_programs(0) + pid, n1 + n2)

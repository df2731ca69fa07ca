"""What the FlashAttention-2 kernels (``kernels.flash_attention``, ``kernels.flash_backward``) share:
the optional triton import, head-dim padding, the causal loop bounds and the document-mask tile range.

Causal blocks entirely above the diagonal are skipped by the loop bounds (Dao 2023, §3.1.1,
"Causal masking"); only diagonal (and ragged-end) blocks pay for a mask. :func:`forward_key_range`
and :func:`backward_query_range` are those bounds in Python, for the tests.

Document masks (packed samples): token ids are non-decreasing along q and along k, so the tiles of the
other side that share a document with a tile form one contiguous run (:func:`_doc_tiles`, a vectorised
scan of each tile's first and last id); the loops are narrowed to it and never load K/V (or Q, dO) of a
fully masked tile. Inside the run, the equality of ids is the mask.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # torch-only installs: impl="torch" still works; kernels.attend.resolve_impl explains
    triton = None
    tl = None

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 128  # any head dim up to this (larger ones: torch SDPA, see kernels.attend.resolve_impl)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Tiles whose first and last document ids one step of _doc_tiles loads at once (a vector); a constexpr, so the
# @jit functions may read it as a global.
DOC_SCAN = tl.constexpr(64) if tl is not None else 64


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
def _block_tile(pid, N_CTX, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Positions pid*BLOCK.. of a sequence and the head-dim lanes: their offsets, which positions exist, and
    the mask of the (positions x lanes) tile (ragged positions and padded lanes load as 0)."""
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    inside = offs < N_CTX
    return offs, offs_d, inside, inside[:, None] & _lanes(offs_d, HEAD_DIM, BLOCK_D)[None, :]


@_jit
def _key_block(k_base, v_base, skn, skd, svn, svd, start_n, N_CTX, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, V_TRANSPOSED: tl.constexpr):
    """One key block of the inner loops (forward, dQ): its key offsets, K^T (head dim x keys) and V, as
    (keys x head dim) for the forward's P V or transposed for the dQ pass's dO V^T. Masks are constant along
    one axis (keys inside the sequence x real head-dim lanes), so the loads stay vectorised along head_dim."""
    offs_d = tl.arange(0, BLOCK_D)
    lanes = _lanes(offs_d, HEAD_DIM, BLOCK_D)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    cols = offs_n < N_CTX
    kt = tl.load(k_base + offs_n[None, :] * skn + offs_d[:, None] * skd, mask=cols[None, :] & lanes[:, None],
                 other=0.0)
    if V_TRANSPOSED:
        v = tl.load(v_base + offs_n[None, :] * svn + offs_d[:, None] * svd, mask=cols[None, :] & lanes[:, None],
                    other=0.0)
    else:
        v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=cols[:, None] & lanes[None, :],
                    other=0.0)
    return offs_n, kt, v


@_jit
def _keep(offs_m, offs_n, N_CTX, CAUSAL: tl.constexpr):
    """Scores that exist: key inside the sequence and, causal, not after the query."""
    keep = offs_n[None, :] < N_CTX
    if CAUSAL:
        keep = keep & (offs_m[:, None] >= offs_n[None, :])
    return keep


@_jit
def _doc_tiles(IDS, first, last, lo, hi, N_CTX, BLOCK: tl.constexpr, SCAN: tl.constexpr):
    """[a, z): the tiles starting at lo, lo + BLOCK, .. below hi (of length BLOCK, cut at N_CTX) whose document
    ids (non-decreasing, from IDS) meet [first, last]; those tiles are contiguous, so this is the whole set.
    Empty: (lo, lo). z is at most hi, so the callers' causal bounds still hold."""
    a = hi + 0
    z = hi * 0 + lo  # a tensor like hi from the start: a loop-carried value keeps its type
    for c in range(lo, hi, BLOCK * SCAN):
        starts = c + tl.arange(0, SCAN) * BLOCK
        inside = starts < hi
        head = tl.load(IDS + starts, mask=inside, other=0)
        tail = tl.load(IDS + tl.minimum(starts + BLOCK, N_CTX) - 1, mask=inside, other=0)
        seen = inside & (head <= last) & (tail >= first)
        a = tl.minimum(a, tl.min(tl.where(seen, starts, hi), 0))
        z = tl.maximum(z, tl.max(tl.where(seen, starts + BLOCK, lo), 0))
    return tl.minimum(a, z), tl.minimum(z, hi)


@_jit
def _doc_edges(IDS, start, N_CTX, BLOCK: tl.constexpr):
    """The first and last document id of the tile starting at ``start`` (ids non-decreasing: its min and max)."""
    return tl.load(IDS + start), tl.load(IDS + tl.minimum(start + BLOCK, N_CTX) - 1)


@_jit
def _query_key_runs(QD, KD, b, pid, offs_m, rows, split, end, N_CTX, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    DOCS: tl.constexpr):
    """A query block's key tiles, as two runs [lo1, hi1) below the causal diagonal's first tile ``split`` and
    [lo2, hi2) from it to ``end`` (``_fwd_bounds``); with DOCS cut to the tiles that share a document with the
    block (``_doc_tiles``). Also the block's query document ids and the batch row's key ids (DOCS; else
    placeholders the callers do not read). The forward and the dQ kernel visit the same tiles."""
    if DOCS:
        kd_base = KD + b * N_CTX
        q_ids = tl.load(QD + b * N_CTX + offs_m, mask=rows, other=-1)
        first, last = _doc_edges(QD + b * N_CTX, pid * BLOCK_M, N_CTX, BLOCK_M)
        lo, hi = _doc_tiles(kd_base, first, last, 0, end, N_CTX, BLOCK_N, DOC_SCAN)
        lo2 = tl.maximum(lo, split)
        return kd_base, q_ids, lo, tl.maximum(tl.minimum(hi, split), lo), lo2, tl.maximum(hi, lo2)
    else:
        return KD, offs_m, 0, split, split, end

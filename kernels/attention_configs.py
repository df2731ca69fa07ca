"""The block configurations the attention kernels' autotuner tries, chosen for Hopper (H100/H200).

Each is (BLOCK_M, BLOCK_N, num_warps, num_stages) for one kernel of ``kernels.flash_attention``
("fwd", "dkdv", "dq") and one head-dim class. A small set keeps the first step's autotuning short;
``python -m megazero.kernels.aot`` compiles any configuration for sm_90 without a GPU and reports what it
would use there, which is how these were picked from a wider grid.
"""
from __future__ import annotations

from types import MappingProxyType

# (BLOCK_M, BLOCK_N, num_warps, num_stages) the autotuner tries, per kernel and head-dim class (head dims
# up to 64 share the 64 set, larger ones the 128 set). Chosen by compiling a wider grid for sm_90 (``python -m megazero.kernels.aot``):
# every entry fits Hopper's 227 KB of shared memory per block, lowers tl.dot to wgmma and spills no
# registers; tests/kernels/test_attention_compile.py keeps it so. Candidates that failed: 128x128 tiles at
# 4 warps (spill), 3-4 stage pipelines of 128-wide K/V tiles at head dim 128 (> 227 KB); for the
# atomic-dQ backward ("dkdvq", which also holds a dQ tile) every 64-row key block at head dim 128 spills.
HOPPER_CONFIGS = MappingProxyType({
    ("fwd", 64): ((128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3),
                  (64, 128, 8, 3)),
    ("fwd", 128): ((128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (64, 64, 4, 3), (64, 64, 8, 3)),
    ("dkdv", 64): ((32, 64, 4, 3), (32, 128, 8, 3), (64, 64, 4, 3), (64, 64, 8, 3), (64, 128, 8, 2),
                   (64, 128, 8, 3)),
    ("dkdv", 128): ((32, 64, 4, 3), (32, 64, 8, 3), (32, 128, 8, 2), (32, 128, 8, 3), (64, 64, 8, 2),
                    (64, 64, 8, 3)),
    ("dkdvq", 64): ((32, 64, 8, 3), (32, 128, 8, 3), (64, 64, 4, 3), (64, 64, 8, 3), (64, 128, 8, 2),
                    (64, 128, 8, 3)),
    ("dkdvq", 128): ((32, 64, 8, 2), (32, 64, 8, 3), (32, 128, 8, 2), (32, 128, 8, 3), (64, 32, 8, 3),
                     (128, 32, 8, 2)),
    ("dq", 64): ((64, 32, 4, 3), (64, 64, 4, 3), (64, 64, 8, 3), (128, 32, 4, 3), (128, 64, 8, 2),
                 (128, 64, 8, 3)),
    ("dq", 128): ((64, 32, 8, 3), (64, 64, 4, 3), (64, 64, 8, 3), (128, 32, 8, 3), (128, 64, 8, 2),
                  (128, 64, 8, 3)),
})
# One small tile for GPUs with less shared memory than Hopper (the autotuner drops what does not fit).
SMALL_CONFIG = (32, 32, 4, 2)
# The document-masked variants (DOCS) hold the query block's ids and scan for its key run: a few more registers,
# so these spill on sm_90 (8-40 bytes of stack per thread, causal or, the 128x128 forward, not) and are left out
# of their sets; their small tile runs 8 warps (4 spill at dQ, head dim 128).
DOC_SPILLS = MappingProxyType({
    ("fwd", 64): ((128, 64, 4, 3), (128, 64, 4, 4)), ("fwd", 128): ((128, 128, 8, 3),), ("dkdv", 128): ((32, 64, 4, 3),),
    ("dkdvq", 64): ((64, 64, 4, 3),), ("dkdvq", 128): ((128, 32, 8, 2),)})
SMALL_DOC_CONFIG = (32, 32, 8, 2)


def head_dim_class(head_dim: int) -> int:
    """The HOPPER_CONFIGS column a head dim uses."""
    return 64 if head_dim <= 64 else 128


def configs_for(kind: str, head_dim: int, docs: bool = False) -> tuple[tuple[int, int, int, int], ...]:
    """The (BLOCK_M, BLOCK_N, num_warps, num_stages) candidates the autotuner times for one kernel (``docs``: its
    document-masked variant)."""
    key = kind, head_dim_class(head_dim)
    if not docs:
        return (*HOPPER_CONFIGS[key], SMALL_CONFIG)
    return (*(c for c in HOPPER_CONFIGS[key] if c not in DOC_SPILLS.get(key, ())), SMALL_DOC_CONFIG)

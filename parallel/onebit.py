"""1-bit compressed all-reduce with error feedback (Tang et al. 2021, "1-bit Adam", section 4 and Algorithm 1):
the average over the data-parallel ranks of a tensor, sent as signs packed 8 per byte with one scale per chunk.

Two phases, each rank both a worker and the server of its 1/n chunk:

1. worker: ``c = x + e_w`` (its worker error), compressed to ``s_w * sign(c)`` with ``s_w = ||c||_2 / sqrt(len)``
   per destination chunk; ``e_w <- c - s_w sign(c)``. One ``all_to_all`` carries chunk r's packed signs and
   scale to rank r.
2. server: rank r averages the n workers' decompressed chunk r, adds its server error, compresses the sum the
   same way (``e_s`` keeps the remainder) and one ``all_gather`` hands every rank every server's chunk.

Bytes leaving a rank per call, for N elements over n ranks: (n-1)/n (N/8 + 4) twice, against an fp32 ring
all-reduce's 2 (n-1)/n 4N: 1/32 of it (plus the scales). The error buffers are what makes the compressed
momentum converge like the exact one; they belong to the rank (a checkpoint saves them per rank).

``live`` (0 or 1 per element, the same on every rank) leaves elements out as if they did not exist: they are sent
as 0, kept out of their chunk's norm and its element count, and keep no error. The padding is such an element,
and so is one whose Adam variance is ~0 (a vocabulary row no token used): the sign would move it by a whole scale
where the exact momentum is 0.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from parallel.comm import Comm

_WEIGHTS = 2 ** torch.arange(8, dtype=torch.uint8)  # bit j of a byte is element j of its group of 8


def pack_signs(x: Tensor) -> Tensor:
    """One bit per element of a 1-D tensor whose length is a multiple of 8: 1 where x >= 0 (sign(0) is +1, so
    every element moves), packed little-endian into uint8."""
    assert x.dim() == 1 and x.numel() % 8 == 0, tuple(x.shape)
    bits = (x >= 0).to(torch.uint8).view(-1, 8)
    return (bits * _WEIGHTS.to(x.device)).sum(1, dtype=torch.uint8)


def unpack_signs(packed: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The +1 / -1 values :func:`pack_signs` packed."""
    bits = packed.view(-1, 1).bitwise_and(_WEIGHTS.to(packed.device)).ne(0)
    return bits.view(-1).to(dtype).mul_(2).sub_(1)


def _compress(c: Tensor, chunks: int, counts: Optional[Tensor], live: Optional[Tensor]
              ) -> tuple[Tensor, Tensor, Tensor]:
    """(packed signs, per-chunk scales, decompressed value) of ``c`` cut into ``chunks`` equal chunks; ``counts``:
    each chunk's live elements (None: all), ``live``: the 0/1 mask the decompressed value is multiplied by."""
    parts = c.view(chunks, -1)
    length = counts if counts is not None else torch.full((chunks,), float(parts.shape[1]), device=c.device)
    scales = parts.norm(dim=1) / length.clamp(min=1.0).sqrt()
    sent = torch.where(parts >= 0, 1.0, -1.0).to(c.dtype).mul_(scales[:, None]).view(-1)
    if live is not None:
        sent.mul_(live)
    return pack_signs(c), scales, sent


def padded_length(numel: int, ranks: int) -> int:
    """The error buffers' length for ``numel`` elements: a multiple of 8 * ranks (whole bytes per chunk)."""
    unit = 8 * ranks
    return -(-numel // unit) * unit


def compressed_allreduce(x: Tensor, worker_error: Tensor, server_error: Tensor, comm: Comm,
                         tag: str = "onebit", live: Optional[Tensor] = None) -> Tensor:
    """The mean over ``comm`` of every rank's ``x`` (1-D, fp32, ``padded_length`` long), compressed both ways;
    ``worker_error`` (that length) and ``server_error`` (1/n of it) are updated in place. ``live``: see above."""
    n = comm.size
    assert x.dim() == 1 and x.numel() % (8 * n) == 0, (tuple(x.shape), n)
    assert worker_error.shape == x.shape and server_error.numel() == x.numel() // n
    chunk = x.numel() // n
    counts = live.view(n, chunk).sum(1) if live is not None else None
    mine_live = live.view(n, chunk)[comm.rank] if live is not None else None
    c = x + worker_error
    if live is not None:
        c.mul_(live)
    packed, scales, sent = _compress(c, n, counts, live)
    worker_error.copy_(c - sent)
    if n == 1:
        mine = sent
    else:
        got = comm.all_to_all(packed.view(n, -1), [1] * n, [1] * n, tag=tag)  # (n, chunk / 8): chunk r of each
        got_scales = comm.all_to_all(scales.view(n, 1), [1] * n, [1] * n, tag=tag)
        mine = (unpack_signs(got.reshape(-1)).view(n, chunk) * got_scales).mean(0)
        if mine_live is not None:
            mine.mul_(mine_live)
    c = mine + server_error
    packed, scale, sent = _compress(c, 1, counts[comm.rank:comm.rank + 1] if counts is not None else None,
                                    mine_live)
    server_error.copy_(c - sent)
    if n == 1:
        return sent
    everyone = torch.empty(n * packed.numel(), dtype=torch.uint8, device=x.device)
    comm.all_gather_into(everyone, packed, tag=tag)
    scales = torch.empty(n, dtype=scale.dtype, device=x.device)
    comm.all_gather_into(scales, scale, tag=tag)
    out = (unpack_signs(everyone).view(n, chunk) * scales[:, None]).view(-1)
    return out.mul_(live) if live is not None else out

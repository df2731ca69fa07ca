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

``groups`` (a small integer per element, the same on every rank) gives each element its scale group: 0 leaves
it out as if it did not exist (sent as 0, out of every norm and count, no error kept: the padding, or an element
whose Adam variance is ~0, where a sign would move it by a whole scale against an exact momentum of 0); groups
1..K each get their own scale per chunk, so an element's compressed value depends on its own group's elements
only. That is what keeps copies of a parameter on other ranks (tp-replicated norms, pipeline-tied embeddings),
fed the same values in the same places, bit-identical: their buckets differ only in the other groups.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from megazero.parallel.comm import Comm

def _bit_weights(device: torch.device) -> Tensor:
    """Bit j of a byte is element j of its group of 8: made where it is used (no copy from the host)."""
    return torch.bitwise_left_shift(torch.ones(8, dtype=torch.uint8, device=device),
                                    torch.arange(8, dtype=torch.uint8, device=device))


def pack_signs(x: Tensor) -> Tensor:
    """One bit per element of a 1-D tensor whose length is a multiple of 8: 1 where x >= 0 (sign(0) is +1, so
    every element moves), packed little-endian into uint8."""
    assert x.dim() == 1 and x.numel() % 8 == 0, tuple(x.shape)
    bits = (x >= 0).to(torch.uint8).view(-1, 8)
    return (bits * _bit_weights(x.device)).sum(1, dtype=torch.uint8)


def unpack_signs(packed: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The +1 / -1 values :func:`pack_signs` packed."""
    bits = packed.view(-1, 1).bitwise_and(_bit_weights(packed.device)).ne(0)
    return bits.view(-1).to(dtype).mul_(2).sub_(1)


# what one more operation costs, in elements streamed: a kernel launch on a GPU, an op's dispatch on the host
_LAUNCH = {"cuda": 2 ** 22, "cpu": 2 ** 13}


@dataclass(frozen=True)
class GroupLayout:
    """Where a bucket's scale groups lie, for ``chunks`` equal chunks of ``groups``: ``counts`` (chunks, K + 1),
    each group's elements per chunk (column 0: those left out); ``spans[i]``, chunk i's (group, first, end) for
    each group present in it, its elements' first and one-past-last places; ``places[i]``, the same spans'
    flat places ``row * (K + 1) + group`` in ``counts`` (on the device). ``by_span``: a group's norm and spread
    read its span in each chunk only (one pass over the bucket when the spans do not overlap, an operation per
    span), rather than the whole bucket once per group, vectorised over the chunks (K passes, an operation per
    group): whichever streams less, launches counted (many groups: spans; few groups over many chunks: passes)."""

    counts: Tensor
    spans: list[list[tuple[int, int, int]]]
    places: list[Tensor]
    all_places: Tensor
    by_span: bool


def group_layout(groups: Tensor, chunks: int, group_count: int) -> GroupLayout:
    """The layout of ``groups`` (uint8, values 0..group_count) over ``chunks`` chunks: the groups' runs, found
    once on the host (the groups change only with the variance's live mask)."""
    parts = groups.view(chunks, -1)
    counts = torch.zeros(chunks, group_count + 1, dtype=torch.long)
    spans, places = [], []
    for i, row in enumerate(parts.cpu()):
        starts = torch.nonzero(torch.cat([torch.ones(1, dtype=torch.bool), row[1:] != row[:-1]])).view(-1)
        ends = torch.cat([starts[1:], torch.tensor([row.numel()])])
        ids = row[starts].long()
        counts[i].index_add_(0, ids, ends - starts)
        live = ids > 0
        first = torch.full((group_count + 1,), row.numel()).scatter_reduce(0, ids[live], starts[live], "amin")
        last = torch.zeros(group_count + 1, dtype=torch.long).scatter_reduce(0, ids[live], ends[live], "amax")
        present = torch.nonzero(first < row.numel()).view(-1)
        spans.append(list(zip(present.tolist(), first[present].tolist(), last[present].tolist())))
        places.append(torch.tensor([k for k, _, _ in spans[-1]], dtype=torch.long))
    all_places = torch.cat([p + i * (group_count + 1) for i, p in enumerate(places)]).to(groups.device)
    launch = _LAUNCH.get(groups.device.type, _LAUNCH["cuda"])
    spanned = sum(z - a + launch for row in spans for _, a, z in row)
    by_span = spanned < group_count * (groups.numel() + launch)
    return GroupLayout(counts.float().to(groups.device), spans, [p.to(groups.device) for p in places], all_places,
                       by_span)



def _compress(c: Tensor, chunks: int, groups: Optional[Tensor], layout: Optional[GroupLayout], rows: list[int]
              ) -> tuple[Tensor, Tensor, Tensor]:
    """(packed signs, scales (chunks, K + 1), decompressed value) of ``c`` cut into ``chunks`` equal chunks:
    ``groups`` (chunks, length), whose chunks are ``layout``'s ``rows``, or None (one group, every element live).
    Group 0's scale is 0. A group's norm squares its own elements (fp32) and sums them in float64."""
    parts = c.view(chunks, -1)
    signs = torch.where(parts >= 0, 1.0, -1.0).to(c.dtype)
    if groups is None:
        scales = torch.cat([torch.zeros(chunks, 1, dtype=c.dtype, device=c.device),
                            parts.norm(dim=1, keepdim=True) / math.sqrt(parts.shape[1])], 1)
        return pack_signs(c), scales, signs.mul_(scales[:, 1:]).view(-1)
    width = layout.counts.shape[1]
    sums = torch.zeros(chunks, width, dtype=torch.float64, device=c.device)
    if not layout.by_span:
        for k in range(1, width):
            sums[:, k] = torch.where(groups == k, parts, 0.0).square().sum(1, dtype=torch.float64)
    else:
        squares = [torch.where(groups[i, a:z] == k, parts[i, a:z], 0.0).square().sum(dtype=torch.float64)
                   for i, row in enumerate(rows) for k, a, z in layout.spans[row]]
        if squares:
            places = layout.all_places if chunks > 1 else layout.places[rows[0]]
            sums.view(-1)[places] = torch.stack(squares)
    counts = layout.counts if chunks > 1 else layout.counts[rows[0]:rows[0] + 1]  # a slice: no index to copy
    scales = (sums.sqrt_() / counts.double().clamp(min=1.0).sqrt_()).to(c.dtype)
    return pack_signs(c), scales, signs.mul_(_spread(scales, groups, layout, rows)).view(-1)


def _spread(scales: Tensor, groups: Tensor, layout: GroupLayout, rows: list[int]) -> Tensor:
    """Each element's scale: ``scales`` (chunks or workers, K + 1) by ``groups`` (one row per scales row, or one
    row for them all, the chunks ``rows`` of ``layout``)."""
    out = torch.zeros(scales.shape[0], groups.shape[-1], dtype=scales.dtype, device=scales.device)
    if not layout.by_span:
        for k in range(1, scales.shape[1]):
            out = torch.where(groups == k, scales[:, k:k + 1], out)
        return out
    shared = groups.shape[0] == 1
    for i, row in enumerate(rows):
        for k, a, z in layout.spans[row]:
            lines = slice(None) if shared else slice(i, i + 1)
            piece = out[lines, a:z]
            piece.copy_(torch.where(groups[i:i + 1, a:z] == k, scales[lines, k:k + 1], piece))
    return out


def padded_length(numel: int, ranks: int) -> int:
    """The error buffers' length for ``numel`` elements: a multiple of 8 * ranks (whole bytes per chunk)."""
    unit = 8 * ranks
    return -(-numel // unit) * unit


def compressed_allreduce(x: Tensor, worker_error: Tensor, server_error: Tensor, comm: Comm,
                         tag: str = "onebit", groups: Optional[Tensor] = None, group_count: int = 1,
                         layout: Optional[GroupLayout] = None) -> Tensor:
    """The mean over ``comm`` of every rank's ``x`` (1-D, fp32, ``padded_length`` long), compressed both ways;
    ``worker_error`` (that length) and ``server_error`` (1/n of it) are updated in place. ``groups`` (uint8, that
    length, values 0..``group_count``): see above; ``layout``: ``group_layout`` of them over ``comm.size``
    chunks, if the caller keeps it (the groups rarely change)."""
    n = comm.size
    assert x.dim() == 1 and x.numel() % (8 * n) == 0, (tuple(x.shape), n)
    assert worker_error.shape == x.shape and server_error.numel() == x.numel() // n
    chunk = x.numel() // n
    if groups is not None and layout is None:
        layout = group_layout(groups, n, group_count)
    by_chunk = groups.view(n, chunk) if groups is not None else None
    everyone_rows, my_row = list(range(n)), [comm.rank]
    c = x + worker_error
    if groups is not None:
        c = torch.where(groups > 0, c, 0.0)
    packed, scales, sent = _compress(c, n, by_chunk, layout, everyone_rows)
    worker_error.copy_(c - sent)
    mine_groups = by_chunk[comm.rank:comm.rank + 1] if groups is not None else None
    if n == 1:
        mine = sent
    else:
        got = comm.all_to_all(packed.view(n, -1), [1] * n, [1] * n, tag=tag)  # (n, chunk / 8): chunk r of each
        got_scales = comm.all_to_all(scales[:, 1:].contiguous(), [1] * n, [1] * n, tag=tag)  # (n, K)
        got_scales = torch.cat([torch.zeros(n, 1, dtype=got_scales.dtype, device=x.device), got_scales], 1)
        signs = unpack_signs(got.reshape(-1)).view(n, chunk)
        if groups is None:
            mine = (signs * got_scales[:, 1:]).mean(0)
        else:
            mine = (signs * _spread(got_scales, mine_groups, layout, my_row)).mean(0)
    c = mine + server_error
    packed, scale, sent = _compress(c, 1, mine_groups, layout, my_row)
    server_error.copy_(c - sent)
    if n == 1:
        return sent
    everyone = torch.empty(n * packed.numel(), dtype=torch.uint8, device=x.device)
    comm.all_gather_into(everyone, packed, tag=tag)
    k = scale.shape[1] - 1
    scales = torch.empty(n * k, dtype=scale.dtype, device=x.device)
    comm.all_gather_into(scales, scale[0, 1:].contiguous(), tag=tag)
    scales = torch.cat([torch.zeros(n, 1, dtype=scale.dtype, device=x.device), scales.view(n, k)], 1)
    signs = unpack_signs(everyone).view(n, chunk)
    if groups is None:
        return (signs * scales[:, 1:]).view(-1)
    return (signs * _spread(scales, by_chunk, layout, everyone_rows)).view(-1)

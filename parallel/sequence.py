"""What one rank sees of a microbatch's sequences: its tokens, their targets, their positions and documents.

At cp = 1 a rank holds whole sequences. Under context parallelism it holds chunks i and 2·cp−1−i of each
(``parallel.context``'s head-tail split), so the positions its rotary or learned embeddings use are those
chunks' positions, not 0..s/cp−1. With document masking (``data.document_mask``) a packed sample's tokens
attend only to earlier tokens of their own document; the document index of every token of the *whole*
sample travels with the microbatch (a few bytes a token), so each rank knows the documents of the K/V blocks
it receives. ``data.reset_positions`` restarts positions at each document (Megatron's reset_position_ids).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from megazero.parallel.comm import Comm
from megazero.parallel.context import head_tail_split


@dataclass
class SequenceInfo:
    """The attention's view of one microbatch on this rank.

    positions: (s_local,) shared by the batch, or (b, s_local) when positions restart at documents.
    documents: (b, s) the document index of every token of the whole sample (None: one causal mask), in
    sequence order, on the device."""

    positions: Tensor
    documents: Optional[Tensor] = None
    host_documents: Optional[Tensor] = None  # the same on the host: which ring blocks to skip, without a sync


def document_ids(tokens: Tensor, eos: int) -> Tensor:
    """(b, s) document index of each input token: a token after an end-of-document token starts a new one."""
    ends = (tokens == eos).to(torch.int32)
    return torch.cumsum(ends, dim=1) - ends  # the end token itself still belongs to its document


def document_mask_share(tokens: Tensor, eos: int) -> float:
    """The share of the causal mask's entries a document mask keeps over the rows of ``tokens`` ((b, s) input
    ids, on the host): per row, the sum over its documents of l(l+1)/2 over s(s+1)/2. The attention kernels
    skip what the mask removes, so the attention FLOPs of a step (megazero.costs.attention_flops_per_token)
    are this share of the causal count."""
    b, s = tokens.shape
    rows = torch.arange(b, device=tokens.device).view(b, 1) * (s + 1)  # document ids unique over the rows
    lengths = torch.unique_consecutive((document_ids(tokens, eos) + rows).flatten(), return_counts=True)[1]
    lengths = lengths.double()
    return float((lengths * (lengths + 1)).sum() / (b * s * (s + 1)))


def document_positions(documents: Tensor) -> Tensor:
    """(b, s) each token's position inside its document (``data.reset_positions``)."""
    b, s = documents.shape
    index = torch.arange(s, device=documents.device).expand(b, s)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index))
    return index - torch.cummax(first, dim=1).values


class SequenceSplit:
    """Turns a microbatch of token rows (b, s+1) into this rank's (inputs, targets, SequenceInfo)."""

    def __init__(self, cp: Comm, eos: Optional[int] = None, document_mask: bool = False,
                 reset_positions: bool = False):
        assert not (document_mask or reset_positions) or eos is not None, "documents need the end token"
        self.cp, self.eos = cp, eos
        self.document_mask, self.reset_positions = document_mask, reset_positions

    def local(self, x: Tensor) -> Tensor:
        """This rank's part of whole sequences along dim 1 (all of it at cp = 1)."""
        return head_tail_split(x, 1, self.cp.size, self.cp.rank) if self.cp.size > 1 else x

    def __call__(self, mb: Tensor, device: torch.device) -> tuple[Tensor, Tensor, SequenceInfo]:
        tokens, targets = mb[:, :-1], mb[:, 1:]
        s = tokens.shape[1]
        documents = document_ids(tokens, self.eos) if self.document_mask or self.reset_positions else None
        if self.reset_positions:
            positions = self.local(document_positions(documents)).to(device, non_blocking=True)
        else:  # made on the device: no host-to-device copy per microbatch
            positions = self.local(torch.arange(s, device=device).view(1, s))[0]
        info = SequenceInfo(positions)
        if self.document_mask:
            info.documents, info.host_documents = documents.to(device, non_blocking=True), documents
        return (self.local(tokens).to(device, non_blocking=True), self.local(targets).to(device, non_blocking=True),
                info)

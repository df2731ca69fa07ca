"""The pre-norm transformer block (Radford et al. 2019, section 2.3), one class for every architecture.

``Block(norm1, attention, norm2, mlp)``: ``x + attention(norm1(x))``, then ``+ mlp(norm2(x))``. GPT-2 and
Llama differ only in the parts (``models.parts``). Each branch (attention or MLP) is a module with
``forward(x, entry=None)``, an ``output`` (its row-parallel projection) and a ``dropout``: with
``parallel.tp_overlap`` the block runs the microbatch as two halves and reduces the branches' partial sums
itself. The parts are registered as ``ln1``, ``attn``, ``ln2``, ``mlp``: the parameter names checkpoints,
the Hugging Face tables and the initialisation read.
"""
from __future__ import annotations

from functools import partial
from typing import Optional

from torch import Tensor, nn

from megazero.parallel.sequence import SequenceInfo
from megazero.parallel.tp_overlap import Sublayer, overlapped_block


class Block(nn.Module):
    def __init__(self, norm1: nn.Module, attention: nn.Module, norm2: nn.Module, mlp: nn.Module,
                 overlap: bool = False):
        super().__init__()
        self.ln1 = norm1
        self.attn = attention
        self.ln2 = norm2
        self.mlp = mlp
        self.overlap = overlap

    def forward(self, x: Tensor, info: Optional[SequenceInfo] = None) -> Tensor:
        """``info``: the tokens' positions and documents (``parallel.sequence``), read by the attention."""
        attn = partial(self.attn, info=info)
        if self.overlap:  # the halves split the batch: the rules keep per-sample documents out of this path
            assert info is None or (info.documents is None and info.positions.dim() == 1), "tp_overlap, documents"
            return overlapped_block(x, (Sublayer(self.ln1, attn, self.attn.output, self.attn.dropout),
                                        Sublayer(self.ln2, self.mlp, self.mlp.output, self.mlp.dropout)))
        x = x + attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

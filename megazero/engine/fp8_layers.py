"""train.fp8: which linears run their GEMMs in FP8 (kernels/fp8.py).

Every column- and row-parallel linear of the transformer blocks but the first and the last block's, as
torchtitan and Megatron-core's FP8 recipes leave the model's ends in 16 bits (their inputs and outputs carry
the widest ranges); the embedding and the head are not among them either. The experts' grouped matmuls stay in
16 bits. The master weights and everything else are as train.precision says.
"""
from __future__ import annotations

from torch import nn

from megazero.parallel.tensor import ColumnParallelLinear, RowParallelLinear


def mark_fp8(chunk: nn.Module, recipe: str, layers: int) -> int:
    """Set ``recipe`` on the linears of this chunk's blocks between the first and the last; their count."""
    if recipe == "none":
        return 0
    marked = 0
    for layer_id, block in chunk.layers.items():
        if int(layer_id) in (0, layers - 1):
            continue
        for module in block.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.fp8 = recipe
                marked += 1
    return marked

"""train.compile: each transformer block compiled by ``torch.compile``, as torchtitan compiles per block.

A block, not the whole model: every block of a model runs the same code, so one compilation serves them all
(``torch._dynamo`` lifts a module's parameters into graph inputs: another block is another input, not another
graph), and what lies between the blocks (pipeline sends, ZeRO's gathers and reductions, the loss) stays eager.
Compiled in place (``nn.Module.compile``): the parameters keep their names, so checkpoints, ZeRO's hooks and the
Hugging Face tables see the model they always did. Inductor's cache goes under ``.cache/`` unless
``TORCHINDUCTOR_CACHE_DIR`` says otherwise, so a second run starts from it.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from megazero.parallel.tp_random import ShardedDropout

CACHE_DIR = Path(".cache") / "inductor"


def compile_blocks(chunks: list[nn.Module]) -> None:
    """Compile every block of this rank's model chunks in place. Dropout (p > 0) stays eager, a graph break
    each: compiled, it would draw its masks from inductor's own generator, not the streams the eager run and
    every other layout draw from (``parallel.tp_random``)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(CACHE_DIR.resolve()))
    for chunk in chunks:
        for block in chunk.layers.values():
            for module in block.modules():
                if isinstance(module, ShardedDropout) and module.p > 0:
                    module.forward = torch.compiler.disable(module.forward)
            block.compile()


def compiled_graphs() -> int:
    """Graphs compiled in this process so far: flat after the first steps, or something recompiles."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])

"""What each ``model.arch`` builds its blocks from: a norm, an attention, an MLP, and whether positions are a table.

GPT-2: LayerNorm, multi-head attention over a fused qkv, tanh-GELU, learned positions (``models.gpt2``).
Llama: RMSNorm, grouped-query attention with rotary positions, SwiGLU, no position table (``models.llama``).
A new architecture is a new row here and a file of its parts; the block, the stage and ZeRO stay as they are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from models.arch import is_llama
from models.block import Block
from models.gpt2 import MLP, Attention, layer_norm
from models.llama import LlamaAttention, SwiGLU, rms_norm
from models.split import Split

Part = Callable[[Any, Split], nn.Module]  # (model config, split) -> the module


@dataclass(frozen=True)
class Parts:
    norm: Part
    attention: Part
    mlp: Part
    positions: bool  # a learned position table on the first stage (Llama rotates q and k instead)

    def block(self, cfg: Any, par: Split) -> Block:
        return Block(self.norm(cfg, par), self.attention(cfg, par), self.norm(cfg, par), self.mlp(cfg, par),
                     overlap=par.overlap)


GPT2 = Parts(norm=layer_norm, attention=Attention, mlp=MLP, positions=True)
LLAMA = Parts(norm=rms_norm, attention=LlamaAttention, mlp=SwiGLU, positions=False)


def parts_of(cfg: Any) -> Parts:
    return LLAMA if is_llama(cfg) else GPT2

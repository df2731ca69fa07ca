"""What each ``model.arch`` builds its blocks from: a norm, an attention, an MLP, and whether positions are a table.

GPT-2: LayerNorm, multi-head attention over a fused qkv, tanh-GELU, learned positions (``models.gpt2``).
Llama: RMSNorm, grouped-query attention with rotary positions, SwiGLU, no position table (``models.llama``);
with ``model.moe``, a mixture of experts in place of the SwiGLU of some layers (``models.moe``).
A new architecture is a new row here and a file of its parts; the block, the stage and ZeRO stay as they are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch import nn

from megazero.models.arch import is_llama
from megazero.models.block import Block
from megazero.models.gpt2 import MLP, Attention, layer_norm
from megazero.models.llama import LlamaAttention, SwiGLU, rms_norm
from megazero.models.moe import MoE
from megazero.models.split import Split

Part = Callable[[Any, Split], nn.Module]  # (model config, split) -> the module


@dataclass(frozen=True)
class Parts:
    norm: Part
    attention: Part
    mlp: Part
    positions: bool  # a learned position table on the first stage (Llama rotates q and k instead)
    experts: Optional[Part] = None  # the MLP of a mixture-of-experts layer (model.moe), where the arch has one

    def block(self, cfg: Any, par: Split, layer: int = 0) -> Block:
        """Layer ``layer``'s block: its MLP a mixture of experts where ``model.moe`` puts one."""
        moe = getattr(cfg, "moe", None)
        mixture = moe is not None and moe.is_moe_layer(layer)
        assert not mixture or self.experts is not None, "model.moe needs an architecture with experts"
        mlp = self.experts(cfg, par) if mixture else self.mlp(cfg, par)
        return Block(self.norm(cfg, par), self.attention(cfg, par), self.norm(cfg, par), mlp, overlap=par.overlap)


GPT2 = Parts(norm=layer_norm, attention=Attention, mlp=MLP, positions=True)
LLAMA = Parts(norm=rms_norm, attention=LlamaAttention, mlp=SwiGLU, positions=False, experts=MoE)


def parts_of(cfg: Any) -> Parts:
    return LLAMA if is_llama(cfg) else GPT2

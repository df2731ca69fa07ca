"""The modules an architecture's blocks are built from, as its spec names them (``ModelSpec.parts``).

GPT-2: LayerNorm, multi-head attention over a fused qkv, tanh-GELU (``models.gpt2``). Llama: RMSNorm,
grouped-query attention with rotary positions, SwiGLU (``models.llama``); with ``model.moe``, a mixture of experts
in place of the SwiGLU of some layers (``models.moe``). The block, the stage and ZeRO stay as they are.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megazero.models.registry import spec_of
from megazero.models.spec import Parts

if TYPE_CHECKING:
    from megazero.models.config import ModelConfig


def parts_of(cfg: "ModelConfig") -> Parts:
    """The modules of ``cfg.arch`` (imported now: they bring torch)."""
    return spec_of(cfg).parts()

"""One architecture, as one object: :class:`ModelSpec` — its modules, what ``auto`` means for its keys, its
parameter and FLOP counts per layer, its Hugging Face tables and its rules.

Everything outside models/ asks the spec (``cfg.spec``, ``models.registry.spec_of``) instead of comparing
``model.arch`` with a name; ``tests/models/test_spec_boundaries.py`` keeps it so. A new architecture is a file
that builds its spec (``models.gpt2_spec`` is the pattern) and a row in ``models.registry``. Nothing here imports
torch: a config is loaded and checked without it, and the modules are imported when a model is built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from megazero.models.hf import HfSpec

if TYPE_CHECKING:
    from torch import nn

    from megazero.models.block import Block
    from megazero.models.config import ModelConfig
    from megazero.models.split import Split

Part = Callable[["ModelConfig", "Split"], "nn.Module"]  # (model config, split) -> the module


@dataclass(frozen=True)
class Parts:
    """What an architecture builds its blocks from: a norm, an attention, an MLP, and the MLP of a
    mixture-of-experts layer (model.moe) where the architecture has one."""

    norm: Part
    attention: Part
    mlp: Part
    experts: Optional[Part] = None

    def block(self, cfg: "ModelConfig", par: "Split", layer: int = 0) -> "Block":
        """Layer ``layer``'s block: its MLP a mixture of experts where ``model.moe`` puts one."""
        from megazero.models.block import Block

        mixture = cfg.moe.is_moe_layer(layer)
        assert not mixture or self.experts is not None, "model.moe needs an architecture with experts"
        mlp = self.experts(cfg, par) if mixture else self.mlp(cfg, par)
        return Block(self.norm(cfg, par), self.attention(cfg, par), self.norm(cfg, par), mlp, overlap=par.overlap)


@dataclass(frozen=True)
class Refusal:
    """A model config the architecture cannot build: the key, its value, and why (``megazero.config.rules``
    writes it as the one-line error, naming the file)."""

    key: str
    value: Any
    why: str


@dataclass(frozen=True)
class ModelSpec:
    """One ``model.arch``. The flags are what other code asks instead of the name; the callables are this
    architecture's own formulas and tables."""

    name: str  # model.arch
    model_name: str  # how a message names a whole model of it ("GPT", "Llama")
    parts: Callable[[], Parts]  # its modules, imported when called (they bring torch)
    bias: bool  # what model.bias: auto means
    tied: bool  # what model.tie_embeddings: auto means (the output head is the token embedding)
    ffn_rule: Callable[[int], int]  # the MLP width of hidden h when model.ffn_hidden is unset
    learned_positions: bool  # a position table on the first stage (else positions rotate q and k)
    rotary: bool  # rotary positions: model.rope_* mean something
    fused_qkv: bool  # one (3h x h) qkv matrix, not q, k and v
    gated_mlp: bool  # SwiGLU's gate, up and down (else fc1, fc2)
    grouped_query: bool  # model.kv_heads below model.heads
    own_head_dim: bool  # model.head_dim other than hidden / heads
    qk_norm: bool  # model.qk_norm
    experts: bool  # model.moe (a mixture of experts in place of some layers' MLP)
    layer_parameters: Callable[["ModelConfig", bool, bool], int]  # (m, mixture, active) -> one layer's
    final_norm_parameters: Callable[["ModelConfig"], int]
    rules: Callable[["ModelConfig"], Iterator[Refusal]]  # its own checks of a model section, in order
    hf: HfSpec

    @property
    def mlp_matrices(self) -> int:
        """Matrices of a dense MLP (or of each expert): gate, up and down, or fc1 and fc2."""
        return 3 if self.gated_mlp else 2

    @property
    def mlp_inputs(self) -> int:
        """The ffn-wide values the MLP's activation reads per token: gate and up, or fc1's output."""
        return 2 if self.gated_mlp else 1

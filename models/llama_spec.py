"""Llama (Touvron et al. 2023) as a :class:`~megazero.models.spec.ModelSpec`: RMSNorm, grouped-query attention with
rotary positions, SwiGLU, no biases and an untied head by default; its options are ``model.qk_norm`` (Qwen3) and
``model.moe`` (a mixture of experts in place of some layers' SwiGLU: Mixtral, Qwen3-MoE, DeepSeek's router).
Its parameter count per layer and its rules are here; its Hugging Face tables in ``models.llama_hf`` and
``models.llama_hf_read``; the modules in ``models.llama`` and ``models.moe``, imported when a model is built.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from megazero.models import llama_hf, llama_hf_read
from megazero.models.arch import expert_hidden, ffn_hidden, has_bias, head_dim
from megazero.models.hf import HfSpec
from megazero.models.spec import ModelSpec, Parts, Refusal

if TYPE_CHECKING:
    from megazero.models.config import ModelConfig


def _parts() -> Parts:
    from megazero.models.llama import LlamaAttention, SwiGLU, rms_norm
    from megazero.models.moe import MoE

    return Parts(norm=rms_norm, attention=LlamaAttention, mlp=SwiGLU, experts=MoE)


def _ffn_rule(h: int) -> int:
    """SwiGLU's 8h/3 rounded up to a multiple of 256 (Touvron et al. 2023): about GPT-2's 4h MLP parameters in
    three matrices."""
    return -(-(8 * h // 3) // 256) * 256


def _layer_parameters(cfg: "ModelConfig", mixture: bool, active: bool) -> int:
    """RMSNorms (no bias), q/o of h x heads*head_dim, k/v of h x kv_heads*head_dim (and q/k norms), then SwiGLU's
    three ffn x h matrices; or, in a mixture-of-experts layer, a router (E x h), E experts of 3 x expert_hidden x h
    (``active``: top_k of them) and the shared experts, one SwiGLU of shared_experts*expert_hidden."""
    h, n_bias = cfg.hidden, int(has_bias(cfg))
    d = head_dim(cfg)
    q, kv = cfg.heads * d, cfg.kv_head_count * d
    qk_norm = 2 * d if cfg.qk_norm else 0
    attention = 2 * h + 2 * h * q + 2 * h * kv + n_bias * (q + 2 * kv + h) + qk_norm

    def swiglu(width: int) -> int:
        return 3 * width * h + n_bias * (2 * width + h) if width else 0

    if not mixture:
        return attention + swiglu(ffn_hidden(cfg))
    moe, fe = cfg.moe, expert_hidden(cfg)
    routed = (moe.top_k if active else moe.experts) * 3 * fe * h
    return attention + moe.experts * h + routed + swiglu(moe.shared_experts * fe)


def _rules(m: "ModelConfig") -> Iterator[Refusal]:
    """Rotary embeddings rotate pairs of features: each head's width is even."""
    if m.head_width % 2:
        key, value = ("model.head_dim", m.head_dim) if m.head_dim else ("model.heads", m.heads)
        yield Refusal(key, value, f"makes an odd head dim {m.head_width}" + ("" if m.head_dim else
                      " (model.hidden / model.heads)") + "; rotary embeddings rotate pairs of features")


LLAMA = ModelSpec(
    name="llama", model_name="Llama", parts=_parts, bias=False, tied=False, ffn_rule=_ffn_rule,
    learned_positions=False, rotary=True, fused_qkv=False, gated_mlp=True, grouped_query=True,
    own_head_dim=True, qk_norm=True, experts=True,
    layer_parameters=_layer_parameters, final_norm_parameters=lambda cfg: cfg.hidden, rules=_rules,
    hf=HfSpec(classes=llama_hf.CLASSES, titles=llama_hf.TITLES, activation=("hidden_act", ("silu", "swish")),
              model_type=llama_hf.model_type, links=llama_hf.links, config=llama_hf.config, read=llama_hf_read.read,
              buffers=llama_hf.buffers, tokenizer_class="LlamaTokenizer"),
)

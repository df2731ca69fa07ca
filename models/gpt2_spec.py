"""GPT-2 (Radford et al. 2019) as a :class:`~megazero.models.spec.ModelSpec`: LayerNorm, multi-head attention over
a fused qkv, tanh-GELU, learned positions, biases and a tied head by default; its parameter count per layer, its
rules, and its Hugging Face tables (GPT2LMHeadModel: Conv1D weights stored (in, out), one fused c_attn).

The modules are ``models.gpt2``'s, imported only when a model is built.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Iterator

from megazero.kernels.errors import UserError
from megazero.models.arch import ffn_hidden, has_bias
from megazero.models.hf import HfFields, HfSpec, Link
from megazero.models.spec import ModelSpec, Parts, Refusal

if TYPE_CHECKING:
    from megazero.models.config import ModelConfig

BLOCK = MappingProxyType({  # ours -> (HF suffix under transformer.h.{i}., kind)
    "ln1.weight": ("ln_1.weight", "copy"),
    "ln1.bias": ("ln_1.bias", "copy"),
    "attn.qkv.weight": ("attn.c_attn.weight", "qkv"),
    "attn.qkv.bias": ("attn.c_attn.bias", "qkv_bias"),
    "attn.proj.weight": ("attn.c_proj.weight", "t"),
    "attn.proj.bias": ("attn.c_proj.bias", "copy"),
    "ln2.weight": ("ln_2.weight", "copy"),
    "ln2.bias": ("ln_2.bias", "copy"),
    "mlp.fc1.weight": ("mlp.c_fc.weight", "t"),
    "mlp.fc1.bias": ("mlp.c_fc.bias", "copy"),
    "mlp.fc2.weight": ("mlp.c_proj.weight", "t"),
    "mlp.fc2.bias": ("mlp.c_proj.bias", "copy"),
})


def _parts() -> Parts:
    from megazero.models.gpt2 import MLP, Attention, layer_norm

    return Parts(norm=layer_norm, attention=Attention, mlp=MLP)


def _layer_parameters(cfg: "ModelConfig", mixture: bool, active: bool) -> int:
    """Two LayerNorms, the fused qkv and the output projection, fc1 and fc2, each with its bias."""
    assert not mixture, "gpt2 has no mixture-of-experts layers"
    h, f, n_bias = cfg.hidden, ffn_hidden(cfg), int(has_bias(cfg))
    return (2 * _final_norm(cfg)
            + 3 * h * h + n_bias * 3 * h  # qkv
            + h * h + n_bias * h  # attention output projection
            + f * h + n_bias * f  # fc1
            + h * f + n_bias * h)  # fc2


def _final_norm(cfg: "ModelConfig") -> int:
    return cfg.hidden * (1 + int(has_bias(cfg)))


def _rules(m: "ModelConfig") -> Iterator[Refusal]:
    """What GPT-2's attention and positions cannot be: other head widths, k/v heads, rotary keys, experts."""
    if m.head_dim is not None and m.head_dim * m.heads != m.hidden:
        yield Refusal("model.head_dim", m.head_dim, f"sets a head width other than model.hidden / model.heads, "
                      f"which only llama's attention has; unset it for {m.arch}")
    if m.kv_head_count != m.heads:
        yield Refusal("model.kv_heads", m.kv_heads, f"grouped-query attention needs model.arch=llama; gpt2: unset "
                      f"or {m.heads}")
    if m.rope_scaling != "none":
        yield Refusal("model.rope_scaling", m.rope_scaling, "scales rotary positions, which only llama has")
    if m.qk_norm:
        yield Refusal("model.qk_norm", m.qk_norm, "normalises the heads of llama's q and k; false for gpt2")
    if m.moe.experts:
        yield Refusal("model.moe.experts", m.moe.experts, f"mixtures of experts need model.arch=llama (got "
                      f"{m.arch}); set model.moe.experts=0 for a dense {m.arch}")


def _links(m: "ModelConfig", kind: str) -> dict[str, Link]:
    """Every parameter of a resolved config -> its GPT2LMHeadModel tensor."""
    h = m.hidden
    shapes = {"ln1.weight": (h,), "attn.qkv.weight": (3 * h, h), "attn.proj.weight": (h, h),
              "ln2.weight": (h,), "mlp.fc1.weight": (m.ffn_hidden, h), "mlp.fc2.weight": (h, m.ffn_hidden)}
    if m.bias:
        shapes.update({"ln1.bias": (h,), "attn.qkv.bias": (3 * h,), "attn.proj.bias": (h,), "ln2.bias": (h,),
                       "mlp.fc1.bias": (m.ffn_hidden,), "mlp.fc2.bias": (h,)})
    out = {"embed.tokens.weight": Link((m.padded_vocab, h), "transformer.wte.weight", "vocab"),
           "embed.positions.weight": Link((m.seq_len, h), "transformer.wpe.weight", "positions")}
    for i in range(m.layers):
        for name, shape in shapes.items():
            hf, how = BLOCK[name]
            out[f"layers.{i}.{name}"] = Link(shape, f"transformer.h.{i}.{hf}", how)
    out["final_norm.weight"] = Link((h,), "transformer.ln_f.weight")
    if m.bias:
        out["final_norm.bias"] = Link((h,), "transformer.ln_f.bias")
    return out


def _config(m: "ModelConfig", kind: str) -> dict:
    return {"n_positions": m.seq_len, "n_ctx": m.seq_len, "n_embd": m.hidden, "n_layer": m.layers,
            "n_head": m.heads, "n_inner": m.ffn_hidden, "activation_function": "gelu_new",
            "layer_norm_epsilon": float(m.norm_eps), "resid_pdrop": float(m.dropout),
            "embd_pdrop": float(m.dropout), "attn_pdrop": 0.0, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}


def _read(raw: dict, f: HfFields, kind: str) -> dict[str, Any]:
    """A GPT-2 folder's config.json as megazero's keys, and its ``n_positions`` (compared besides)."""
    hidden = f.get("n_embd", int)
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False)):
        if f.get(key, bool, want) != want:
            raise UserError(f"{f.where}: config.json {key}={str(not want).lower()} is not supported; "
                            f"megazero's attention needs {str(want).lower()}")
    return {"arch": "gpt2", "layers": f.get("n_layer", int), "hidden": hidden, "heads": f.get("n_head", int),
            "kv_heads": f.get("n_head", int), "ffn_hidden": f.get("n_inner", int, 4 * hidden),
            "vocab_size": f.get("vocab_size", int), "norm_eps": f.get("layer_norm_epsilon", float, 1e-5),
            "tie_embeddings": f.get("tie_word_embeddings", bool, True), "bias": True,
            "n_positions": f.get("n_positions", int, f.get("n_ctx", int, 1024))}


def _buffers(m: "ModelConfig") -> list[str]:
    """The causal-mask buffers older transformers saved (``attn.bias``, ``attn.masked_bias``)."""
    return [f"transformer.h.{i}.attn.{b}" for i in range(m.layers) for b in ("bias", "masked_bias")]


GPT2 = ModelSpec(
    name="gpt2", model_name="GPT", parts=_parts, bias=True, tied=True, ffn_rule=lambda h: 4 * h,
    learned_positions=True, rotary=False, fused_qkv=True, gated_mlp=False, grouped_query=False,
    own_head_dim=False, qk_norm=False, experts=False,
    layer_parameters=_layer_parameters, final_norm_parameters=_final_norm, rules=_rules,
    hf=HfSpec(classes=MappingProxyType({"gpt2": "GPT2LMHeadModel"}), titles=MappingProxyType({"gpt2": "GPT-2"}),
              activation=("activation_function", ("gelu_new", "gelu_pytorch_tanh")),
              model_type=lambda m, where: "gpt2", links=_links, config=_config, read=_read, buffers=_buffers,
              zero_biases=True),
)

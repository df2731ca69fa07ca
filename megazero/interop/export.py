"""Export a megazero checkpoint as a Hugging Face folder: GPT2LMHeadModel, LlamaForCausalLM, Qwen3ForCausalLM
(``model.qk_norm``), MixtralForCausalLM or Qwen3MoeForCausalLM (``model.moe``, without or with q/k norms).

    python -m megazero.export CHECKPOINT_DIR OUT_DIR [--force]

The folder loads with ``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` and gives megazero's
logits over the real vocabulary. The architectures are the same, so only layouts differ
(``megazero.interop.hf_layout``: GPT-2's Conv1D and fused attention, padded vocabulary rows dropped, an expert
stack as one tensor per expert, as save_pretrained writes them); a bias-free GPT-2 gets zero biases, because
HF's GPT-2 always has them. A mixture of experts that neither HF class holds (shared experts, the sigmoid
router, dense layers without q/k norms...) is refused before anything is read. Attention probabilities are not
dropped out in megazero, so attention dropout is 0. ``router_aux_loss_coef`` is the run's
``model.moe.aux_loss`` (HF's own balancing loss, computed only with ``output_router_logits``, which is off).
transformers has no expert capacity: a run with ``model.moe.capacity_factor`` > 0 (which drops tokens over an
expert's capacity) is exported with a one-line warning that the folder routes every token, so its outputs
differ from the run's wherever tokens were dropped (``capacity_warning``).

Every stored tensor is accounted for (``megazero.interop.export_tensors``): a meta.json that no longer
describes the tensors is refused, not exported as a model with trained weights dropped. The run's tokenizer
(the checkpoint's meta.json records its path) is checked against the vocabulary and copied beside the
weights with a minimal tokenizer_config.json, so ``AutoTokenizer`` gives the ids the model was trained on
(``megazero.interop.export_tokenizer``; a file whose content is no longer what meta.json recorded is
refused); a checkpoint that records none (older megazero) is exported without one, with a note.

Where the folder may go is decided first, on resolved paths (``megazero.interop.export_place``): never
inside a checkpoint or a folder checkpoints are saved into, never over the working folder or a mount point,
and --force replaces only a previous export. The folder is written whole or not at all
(``megazero.interop.export_folder``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from megazero.errors import UserError
from megazero.interop.export_folder import write_hf_folder
from megazero.interop.export_place import check_output
from megazero.interop.export_tensors import check_tensors
from megazero.interop.export_tokenizer import run_tokenizer
from megazero.interop.hf_layout import HF_ARCHITECTURES, hf_shape, hf_tensors, hf_type, links, model_config

__all__ = ["capacity_warning", "check_output", "export", "main", "to_hf_state_dict", "write_hf_folder"]


def to_hf_state_dict(state: Mapping[str, Tensor], model_cfg: Any,
                     special_ids: Optional[Mapping[str, Optional[int]]] = None,
                     where: str = "checkpoint") -> tuple[dict, dict[str, Tensor]]:
    """(config.json dict, HF state dict) from full tensors keyed by megazero's global names, every one of
    them used (``megazero.interop.export_tensors``; ``where`` names them in a refusal).

    ``model_cfg`` is a ModelConfig or the ``model`` section of a run's config as a dict; ``special_ids``
    the tokenizer's ``bos_token_id``/``eos_token_id`` (None: unknown).
    """
    m = model_config(model_cfg)
    kind = hf_type(m, where)
    table = links(m, kind)
    check_tensors({name: tuple(t.shape) for name, t in state.items()}, m, table, where)
    out = {}
    for name, link in table.items():
        out.update(hf_tensors(state[name], link, m))
    dtype = state["embed.tokens.weight"].dtype
    if m.arch == "gpt2" and not m.bias:  # HF's GPT-2 always adds biases: zeros compute the same
        full = links(dataclasses.replace(m, bias=True))
        out.update({link.hf: torch.zeros(hf_shape(link, m), dtype=dtype) for name, link in full.items()
                    if name not in table})
    out = {k: v.detach().cpu().contiguous().clone() for k, v in out.items()}
    ids = {"bos_token_id": None, "eos_token_id": None, **(special_ids or {})}
    config = _gpt2_config(m) if kind == "gpt2" else _llama_config(m, kind)
    config.update(architectures=[HF_ARCHITECTURES[kind]], model_type=kind, vocab_size=m.vocab_size,
                  initializer_range=float(m.init_std), tie_word_embeddings=bool(m.tie_embeddings),
                  torch_dtype=str(dtype).removeprefix("torch."), **ids)
    return config, out


def _gpt2_config(m: Any) -> dict:
    return {"n_positions": m.seq_len, "n_ctx": m.seq_len, "n_embd": m.hidden, "n_layer": m.layers,
            "n_head": m.heads, "n_inner": m.ffn_hidden, "activation_function": "gelu_new",
            "layer_norm_epsilon": float(m.norm_eps), "resid_pdrop": float(m.dropout),
            "embd_pdrop": float(m.dropout), "attn_pdrop": 0.0, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}


def _llama_config(m: Any, kind: str) -> dict:
    """Llama's keys, and Qwen3's, Mixtral's or Qwen3-MoE's (``kind``). Unknown bos/eos ids are written as null:
    left out, transformers would assume Llama 2's 1 and 2. rope_theta is written both ways: transformers 5 reads
    rope_parameters, 4.x the top-level key. Attention is never windowed."""
    theta = float(m.rope_theta)
    scaling = None
    if getattr(m, "rope_scaling", "none") == "llama3":  # Llama 3.1's long-context frequencies
        scaling = {"rope_type": "llama3", "factor": float(m.rope_factor),
                   "low_freq_factor": float(m.rope_low_freq_factor), "high_freq_factor": float(m.rope_high_freq_factor),
                   "original_max_position_embeddings": int(m.rope_original_positions)}
    out = {"hidden_size": m.hidden, "intermediate_size": m.ffn_hidden, "num_hidden_layers": m.layers,
           "num_attention_heads": m.heads, "num_key_value_heads": m.kv_head_count, "head_dim": m.head_width,
           "hidden_act": "silu", "max_position_embeddings": m.seq_len, "rms_norm_eps": float(m.norm_eps),
           "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta, **(scaling or {})},
           "rope_scaling": scaling, "attention_dropout": 0.0, "use_cache": True}
    if kind == "llama":
        return {**out, "attention_bias": bool(m.bias), "mlp_bias": bool(m.bias), "pretraining_tp": 1}
    out["sliding_window"] = None
    if kind in ("qwen3", "qwen3_moe"):
        out.update(attention_bias=bool(m.bias), use_sliding_window=False, max_window_layers=m.layers)
    if kind == "qwen3":
        return out
    moe = m.moe
    width = moe.expert_hidden or m.ffn_hidden
    out.update(num_experts_per_tok=moe.top_k, router_aux_loss_coef=float(moe.aux_loss), output_router_logits=False)
    if kind == "mixtral":  # every layer a mixture of experts intermediate_size wide, the top k renormalised
        return {**out, "intermediate_size": width, "num_local_experts": moe.experts, "router_jitter_noise": 0.0}
    return {**out, "num_experts": moe.experts, "moe_intermediate_size": width, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(m.layers) if not moe.is_moe_layer(i)],
            "norm_topk_prob": bool(moe.norm_topk_prob) and moe.top_k > 1}  # top-1: megazero's gate is the probability


def capacity_warning(m: Any) -> Optional[str]:
    """The one-line warning an export of a model trained with an expert capacity needs: transformers' Mixtral
    and Qwen3-MoE route every token, so the folder is not the model the run computed. None where no token can
    be dropped: dropless (0), or a capacity of every token (factor * top_k >= experts)."""
    moe = m.moe
    factor = float(moe.capacity_factor)
    if not moe.experts or factor <= 0 or factor * moe.top_k >= moe.experts:
        return None
    return (f"model.moe.capacity_factor={factor}: the exported model routes every token (transformers has no "
            f"expert capacity); its outputs differ from this run's where tokens were dropped")


def export(checkpoint_dir: str | Path, out_dir: str | Path, force: bool = False) -> Path:
    """Read a megazero checkpoint and write it, with its tokenizer, as a Hugging Face folder in ``out_dir``.

    Everything that can refuse does so before the (long) read of the tensors: the output's place, meta.json,
    the stored tensors' names and shapes (from the checkpoint's metadata), the tokenizer. A run with an expert
    capacity is warned about on stderr once the folder is written (a refusal stays one line)."""
    ckpt = Path(checkpoint_dir)
    if not ckpt.is_dir():
        raise UserError(f"checkpoint directory '{ckpt}' does not exist")
    check_output(out_dir, force, ckpt)
    from megazero.checkpoint.store import read_meta, read_model_state, stored_tensors

    meta = read_meta(ckpt, require=("config",))  # checked: the model section obeys the config rules
    m = model_config(meta["config"]["model"])
    where = f"checkpoint {ckpt}"
    shapes = {k.removeprefix("model/"): tuple(v.size) for k, v in stored_tensors(ckpt).items()
              if k.startswith("model/")}
    check_tensors(shapes, m, links(m, hf_type(m, where)), where)
    files, ids, note = run_tokenizer(meta, ckpt, m)
    if note:
        print(f"note: {note}")
    hf_config, hf_state = to_hf_state_dict(read_model_state(ckpt), m, ids, where)
    out = write_hf_folder(out_dir, hf_config, hf_state, force, files, ckpt)
    warning = capacity_warning(m)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megazero.export",
        description="Write a megazero checkpoint as a Hugging Face folder (GPT2LMHeadModel, LlamaForCausalLM, "
                    "Qwen3ForCausalLM, MixtralForCausalLM or Qwen3MoeForCausalLM) with its tokenizer.",
    )
    parser.add_argument("checkpoint_dir", help="a checkpoint directory written by megazero")
    parser.add_argument("out_dir", help="folder to write config.json and the weights into (missing or empty; "
                                        "never inside a checkpoint or a log.dir's checkpoints/)")
    parser.add_argument("--force", action="store_true",
                        help="replace a previous export in out_dir, and nothing else (once the new folder is "
                             "complete)")
    args = parser.parse_args(argv)
    try:
        out = export(args.checkpoint_dir, args.out_dir, args.force)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

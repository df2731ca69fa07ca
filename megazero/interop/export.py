"""Export a megazero checkpoint as a Hugging Face folder: GPT2LMHeadModel or LlamaForCausalLM.

    python -m megazero.export CHECKPOINT_DIR OUT_DIR [--force]

The folder loads with ``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` and gives megazero's
logits over the real vocabulary. The architectures are the same, so only layouts differ
(``megazero.interop.hf_layout``: GPT-2's Conv1D and fused attention, padded vocabulary rows dropped); a bias-free
GPT-2 gets zero biases, because HF's GPT-2 always has them. Attention probabilities are not dropped out in
megazero, so attention dropout is 0.

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
from megazero.interop.hf_layout import HF_ARCHITECTURES, hf_shape, links, model_config, to_hf

__all__ = ["check_output", "export", "main", "to_hf_state_dict", "write_hf_folder"]


def to_hf_state_dict(state: Mapping[str, Tensor], model_cfg: Any,
                     special_ids: Optional[Mapping[str, Optional[int]]] = None,
                     where: str = "checkpoint") -> tuple[dict, dict[str, Tensor]]:
    """(config.json dict, HF state dict) from full tensors keyed by megazero's global names, every one of
    them used (``megazero.interop.export_tensors``; ``where`` names them in a refusal).

    ``model_cfg`` is a ModelConfig or the ``model`` section of a run's config as a dict; ``special_ids``
    the tokenizer's ``bos_token_id``/``eos_token_id`` (None: unknown).
    """
    m = model_config(model_cfg)
    table = links(m)
    check_tensors({name: tuple(t.shape) for name, t in state.items()}, m, table, where)
    out = {link.hf: to_hf(state[name], link, m) for name, link in table.items()}
    dtype = state["embed.tokens.weight"].dtype
    if m.arch == "gpt2" and not m.bias:  # HF's GPT-2 always adds biases: zeros compute the same
        full = links(dataclasses.replace(m, bias=True))
        out.update({link.hf: torch.zeros(hf_shape(link, m), dtype=dtype) for name, link in full.items()
                    if name not in table})
    out = {k: v.detach().cpu().contiguous().clone() for k, v in out.items()}
    ids = {"bos_token_id": None, "eos_token_id": None, **(special_ids or {})}
    config = _llama_config(m) if m.arch == "llama" else _gpt2_config(m)
    config.update(architectures=[HF_ARCHITECTURES[m.arch]], model_type=m.arch, vocab_size=m.vocab_size,
                  initializer_range=float(m.init_std), tie_word_embeddings=bool(m.tie_embeddings),
                  torch_dtype=str(dtype).removeprefix("torch."), **ids)
    return config, out


def _gpt2_config(m: Any) -> dict:
    return {"n_positions": m.seq_len, "n_ctx": m.seq_len, "n_embd": m.hidden, "n_layer": m.layers,
            "n_head": m.heads, "n_inner": m.ffn_hidden, "activation_function": "gelu_new",
            "layer_norm_epsilon": float(m.norm_eps), "resid_pdrop": float(m.dropout),
            "embd_pdrop": float(m.dropout), "attn_pdrop": 0.0, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}


def _llama_config(m: Any) -> dict:
    """Unknown bos/eos ids are written as null: left out, transformers would assume Llama 2's 1 and 2.
    rope_theta is written both ways: transformers 5 reads rope_parameters, 4.x the top-level key."""
    theta = float(m.rope_theta)
    scaling = None
    if getattr(m, "rope_scaling", "none") == "llama3":  # Llama 3.1's long-context frequencies
        scaling = {"rope_type": "llama3", "factor": float(m.rope_factor),
                   "low_freq_factor": float(m.rope_low_freq_factor), "high_freq_factor": float(m.rope_high_freq_factor),
                   "original_max_position_embeddings": int(m.rope_original_positions)}
    return {"hidden_size": m.hidden, "intermediate_size": m.ffn_hidden, "num_hidden_layers": m.layers,
            "num_attention_heads": m.heads, "num_key_value_heads": m.kv_head_count, "head_dim": m.head_width,
            "hidden_act": "silu", "max_position_embeddings": m.seq_len, "rms_norm_eps": float(m.norm_eps),
            "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta, **(scaling or {})},
            "rope_scaling": scaling, "attention_bias": bool(m.bias), "mlp_bias": bool(m.bias),
            "attention_dropout": 0.0, "pretraining_tp": 1, "use_cache": True}


def export(checkpoint_dir: str | Path, out_dir: str | Path, force: bool = False) -> Path:
    """Read a megazero checkpoint and write it, with its tokenizer, as a Hugging Face folder in ``out_dir``.

    Everything that can refuse does so before the (long) read of the tensors: the output's place, meta.json,
    the stored tensors' names and shapes (from the checkpoint's metadata), the tokenizer."""
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
    check_tensors(shapes, m, links(m), where)
    files, ids, note = run_tokenizer(meta, ckpt, m)
    if note:
        print(f"note: {note}")
    hf_config, hf_state = to_hf_state_dict(read_model_state(ckpt), m, ids, where)
    return write_hf_folder(out_dir, hf_config, hf_state, force, files, ckpt)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megazero.export",
        description="Write a megazero checkpoint as a Hugging Face folder (GPT2LMHeadModel or "
                    "LlamaForCausalLM) with its tokenizer.",
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

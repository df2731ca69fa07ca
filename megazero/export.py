"""Export a megazero checkpoint as a Hugging Face GPT-2 folder.

    python -m megazero.export CHECKPOINT_DIR OUT_DIR

The folder loads with ``transformers.GPT2LMHeadModel.from_pretrained(OUT_DIR)``
and gives megazero's logits over the real vocabulary. The model is the GPT-2
architecture, so only layouts differ: HF's Conv1D stores weights (in, out),
its fused c_attn is [all q; all k; all v] where ours is grouped per head, the
padded vocabulary rows are dropped, and a bias-free model gets zero biases.
Attention probabilities are not dropped out in megazero, so attn_pdrop is 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from megazero.errors import UserError

_BLOCK = {  # ours -> (HF suffix, transpose)
    "ln1.weight": ("ln_1.weight", False),
    "ln1.bias": ("ln_1.bias", False),
    "attn.proj.weight": ("attn.c_proj.weight", True),
    "attn.proj.bias": ("attn.c_proj.bias", False),
    "ln2.weight": ("ln_2.weight", False),
    "ln2.bias": ("ln_2.bias", False),
    "mlp.fc1.weight": ("mlp.c_fc.weight", True),
    "mlp.fc1.bias": ("mlp.c_fc.bias", False),
    "mlp.fc2.weight": ("mlp.c_proj.weight", True),
    "mlp.fc2.bias": ("mlp.c_proj.bias", False),
}


def _field(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _take(state: Mapping[str, Tensor], name: str) -> Tensor:
    if name not in state:
        raise UserError(f"checkpoint has no parameter '{name}'; it does not hold a complete GPT model")
    return state[name]


def _qkv_to_hf(qkv: Tensor, heads: int) -> Tensor:
    """(3h, ...) per-head [q_h; k_h; v_h] rows -> [q; k; v] rows, each head-major."""
    d = qkv.shape[0] // (3 * heads)
    per_head = qkv.reshape(heads, 3, d, *qkv.shape[1:])
    return per_head.transpose(0, 1).reshape(qkv.shape)


def to_hf_state_dict(state: Mapping[str, Tensor], model_cfg: Any) -> tuple[dict, dict[str, Tensor]]:
    """(config.json dict, GPT2LMHeadModel state dict) from full tensors keyed by megazero's global names.

    ``model_cfg`` is a ModelConfig or the ``model`` section of a run's config as a dict.
    """
    layers, hidden, heads = (int(_field(model_cfg, k)) for k in ("layers", "hidden", "heads"))
    vocab, seq_len = int(_field(model_cfg, "vocab_size")), int(_field(model_cfg, "seq_len"))
    ffn = int(_field(model_cfg, "ffn_hidden") or 4 * hidden)
    dropout = float(_field(model_cfg, "dropout", 0.0))

    def bias_or_zeros(name: str, size: int, like: Tensor) -> Tensor:
        return state[name] if name in state else torch.zeros(size, dtype=like.dtype)

    tokens = _take(state, "embed.tokens.weight")
    if tokens.shape[0] < vocab:
        raise UserError(f"embed.tokens.weight has {tokens.shape[0]} rows, fewer than model.vocab_size={vocab}")
    out = {
        "transformer.wte.weight": tokens[:vocab],
        "transformer.wpe.weight": _take(state, "embed.positions.weight"),
        "transformer.ln_f.weight": _take(state, "final_norm.weight"),
    }
    out["transformer.ln_f.bias"] = bias_or_zeros("final_norm.bias", hidden, tokens)
    for i in range(layers):
        ours, hf = f"layers.{i}.", f"transformer.h.{i}."
        qkv = _take(state, ours + "attn.qkv.weight")
        out[hf + "attn.c_attn.weight"] = _qkv_to_hf(qkv, heads).t()
        qkv_bias = bias_or_zeros(ours + "attn.qkv.bias", 3 * hidden, qkv)
        out[hf + "attn.c_attn.bias"] = _qkv_to_hf(qkv_bias, heads)
        for name, (hf_name, transpose) in _BLOCK.items():
            if name.endswith(".bias"):
                size = ffn if name == "mlp.fc1.bias" else hidden
                t = bias_or_zeros(ours + name, size, qkv)
            else:
                t = _take(state, ours + name)
            out[hf + hf_name] = t.t() if transpose else t
    out = {k: v.detach().cpu().contiguous().clone() for k, v in out.items()}

    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_positions": seq_len,
        "n_ctx": seq_len,
        "n_embd": hidden,
        "n_layer": layers,
        "n_head": heads,
        "n_inner": ffn,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "initializer_range": float(_field(model_cfg, "init_std", 0.02)),
        "resid_pdrop": dropout,
        "embd_pdrop": dropout,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": str(tokens.dtype).removeprefix("torch."),
    }
    return config, out


def write_hf_folder(out_dir: str | Path, hf_config: dict, hf_state: Mapping[str, Tensor]) -> Path:
    """Write config.json and the weights (model.safetensors when safetensors is installed)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"export output '{out}' exists and is not a directory")
    tensors = {k: v.contiguous() for k, v in hf_state.items()}
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        try:
            from safetensors.torch import save_file
        except ImportError:
            torch.save(tensors, out / "pytorch_model.bin")
        else:
            save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    except Exception as e:  # OSError, or safetensors' own error type for a failed write (a full disk)
        if not isinstance(e, OSError) and type(e).__name__ != "SafetensorError":
            raise
        raise UserError(f"export output '{out}': cannot write it ({getattr(e, 'strerror', None) or e})") from None
    return out


def export(checkpoint_dir: str | Path, out_dir: str | Path) -> Path:
    """Read a megazero checkpoint and write it as a Hugging Face GPT-2 folder in ``out_dir``."""
    ckpt = Path(checkpoint_dir)
    if not ckpt.is_dir():
        raise UserError(f"checkpoint directory '{ckpt}' does not exist")
    from megazero.checkpoint import read_checkpoint_config, read_model_state

    config = read_checkpoint_config(ckpt)
    if "model" not in config:
        raise UserError(f"checkpoint '{ckpt}' has a config without a 'model' section")
    hf_config, hf_state = to_hf_state_dict(read_model_state(ckpt), config["model"])
    return write_hf_folder(out_dir, hf_config, hf_state)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megazero.export",
        description="Write a megazero checkpoint as a Hugging Face GPT-2 folder (GPT2LMHeadModel).",
    )
    parser.add_argument("checkpoint_dir", help="a checkpoint directory written by megazero")
    parser.add_argument("out_dir", help="folder to write config.json and the weights into")
    args = parser.parse_args(argv)
    try:
        out = export(args.checkpoint_dir, args.out_dir)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Export a megazero checkpoint as a Hugging Face GPT-2 folder.

    python -m megazero.export CHECKPOINT_DIR OUT_DIR [--force]

The folder loads with ``transformers.GPT2LMHeadModel.from_pretrained(OUT_DIR)``
and gives megazero's logits over the real vocabulary. The model is the GPT-2
architecture, so only layouts differ: HF's Conv1D stores weights (in, out),
its fused c_attn is [all q; all k; all v] where ours is grouped per head, the
padded vocabulary rows are dropped, and a bias-free model gets zero biases.
Attention probabilities are not dropped out in megazero, so attn_pdrop is 0.

The output folder is written whole or not at all: into a temporary sibling,
renamed into place at the end. A non-empty OUT_DIR is refused unless --force,
and even then it is replaced only once the new folder is complete.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import uuid
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


def _check_shapes(state: Mapping[str, Tensor], layers: int, hidden: int, ffn: int, seq_len: int) -> None:
    """Every tensor has the shape the config says: a checkpoint whose config was edited is refused, not
    exported as a model that cannot run."""
    expected = {"embed.positions.weight": (seq_len, hidden), "final_norm.weight": (hidden,),
                "final_norm.bias": (hidden,)}
    block = {"ln1.weight": (hidden,), "ln1.bias": (hidden,), "ln2.weight": (hidden,), "ln2.bias": (hidden,),
             "attn.qkv.weight": (3 * hidden, hidden), "attn.qkv.bias": (3 * hidden,),
             "attn.proj.weight": (hidden, hidden), "attn.proj.bias": (hidden,),
             "mlp.fc1.weight": (ffn, hidden), "mlp.fc1.bias": (ffn,),
             "mlp.fc2.weight": (hidden, ffn), "mlp.fc2.bias": (hidden,)}
    for i in range(layers):
        expected.update({f"layers.{i}.{k}": v for k, v in block.items()})
    for name, shape in expected.items():
        if name in state and tuple(state[name].shape) != shape:
            raise UserError(f"checkpoint parameter '{name}' has shape {tuple(state[name].shape)}, the stored "
                            f"model config (layers={layers}, hidden={hidden}, ffn_hidden={ffn}, seq_len={seq_len}) "
                            f"gives {shape}")
    if f"layers.{layers}.attn.qkv.weight" in state:
        raise UserError(f"checkpoint holds 'layers.{layers}.*', more layers than its model config's layers={layers}")


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

    _check_shapes(state, layers, hidden, ffn, seq_len)
    tokens = _take(state, "embed.tokens.weight")
    if tokens.dim() != 2 or tokens.shape[1] != hidden:
        raise UserError(f"embed.tokens.weight has shape {tuple(tokens.shape)}; the model config's hidden={hidden}")
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


def _is_empty_dir(path: Path) -> bool:
    try:
        return path.is_dir() and next(path.iterdir(), None) is None
    except OSError:
        return False


def check_output(out: Path, force: bool, keep: Path | None = None) -> None:
    """OUT may be missing or an empty folder; a non-empty one only with --force, and never one holding ``keep``."""
    if not os.path.lexists(out):
        return
    if not out.is_dir():
        raise UserError(f"export output '{out}' exists and is not a directory")
    if keep is not None and keep.resolve().is_relative_to(out.resolve()):
        raise UserError(f"export output '{out}' holds the checkpoint {keep}; choose a folder outside it")
    if not force and not _is_empty_dir(out):
        raise UserError(f"export output '{out}' is not empty; pass --force to replace it, or choose a new folder")


def _sibling(out: Path, kind: str) -> Path:
    """A new hidden folder beside ``out`` (same file system, so renames are atomic; made with the user's umask)."""
    path = out.with_name(f".{out.name}.{uuid.uuid4().hex[:12]}.{kind}")
    path.mkdir()
    return path


def _replace(tmp: Path, out: Path) -> None:
    """Put the complete ``tmp`` at ``out``; an old ``out`` is set aside first and removed only afterwards."""
    old = None
    if os.path.lexists(out) and not _is_empty_dir(out):
        old = _sibling(out, "old")
        os.rename(out, old / "out")
    os.rename(tmp, out)  # over a missing or empty folder: one atomic step
    if old is not None:
        target = old / "out"
        if target.is_symlink():  # OUT was a link: replace the link, never touch what it pointed to
            target.unlink()
        shutil.rmtree(old, ignore_errors=True)


def write_hf_folder(out_dir: str | Path, hf_config: dict, hf_state: Mapping[str, Tensor],
                    force: bool = False) -> Path:
    """Write config.json and the weights (model.safetensors when safetensors is installed), all or nothing."""
    out = Path(out_dir)
    check_output(out, force)
    tensors = {k: v.contiguous() for k, v in hf_state.items()}
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = _sibling(out, "tmp")
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        try:
            from safetensors.torch import save_file
        except ImportError:
            torch.save(tensors, tmp / "pytorch_model.bin")
        else:
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _replace(tmp, out)
        tmp = None
    except Exception as e:  # OSError, or safetensors' own error type for a failed write (a full disk)
        if not isinstance(e, OSError) and type(e).__name__ != "SafetensorError":
            raise
        raise UserError(f"export output '{out}': cannot write it ({getattr(e, 'strerror', None) or e})") from None
    finally:
        if tmp is not None:  # a failed write leaves nothing behind, and OUT as it was
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def export(checkpoint_dir: str | Path, out_dir: str | Path, force: bool = False) -> Path:
    """Read a megazero checkpoint and write it as a Hugging Face GPT-2 folder in ``out_dir``."""
    ckpt = Path(checkpoint_dir)
    if not ckpt.is_dir():
        raise UserError(f"checkpoint directory '{ckpt}' does not exist")
    check_output(Path(out_dir), force, keep=ckpt)  # before the (long) read
    from megazero.checkpoint import read_checkpoint_config, read_model_state

    config = read_checkpoint_config(ckpt)  # checked: the model section obeys the config rules
    hf_config, hf_state = to_hf_state_dict(read_model_state(ckpt), config["model"])
    return write_hf_folder(out_dir, hf_config, hf_state, force)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megazero.export",
        description="Write a megazero checkpoint as a Hugging Face GPT-2 folder (GPT2LMHeadModel).",
    )
    parser.add_argument("checkpoint_dir", help="a checkpoint directory written by megazero")
    parser.add_argument("out_dir", help="folder to write config.json and the weights into (missing or empty)")
    parser.add_argument("--force", action="store_true",
                        help="replace a non-empty out_dir (only once the new folder is complete)")
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

"""Export a megazero checkpoint as a Hugging Face folder: GPT2LMHeadModel or LlamaForCausalLM.

    python -m megazero.export CHECKPOINT_DIR OUT_DIR [--force]

The folder loads with ``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` and gives megazero's
logits over the real vocabulary. The architectures are the same, so only layouts differ
(``megazero.interop.hf_layout``: GPT-2's Conv1D and fused attention, padded vocabulary rows dropped); a bias-free
GPT-2 gets zero biases, because HF's GPT-2 always has them. Attention probabilities are not dropped out in
megazero, so attention dropout is 0.

The run's tokenizer (the checkpoint's meta.json records its path) is copied beside the weights with a
minimal tokenizer_config.json, so ``AutoTokenizer`` gives the ids the model was trained on; a checkpoint
that records none (older megazero) is exported without one, with a note.

The output folder is written whole or not at all: into a temporary sibling,
renamed into place at the end. A non-empty OUT_DIR is refused unless --force,
and even then it is replaced only once the new folder is complete.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from megazero.errors import UserError, shown
from megazero.interop.hf_layout import HF_ARCHITECTURES, Link, hf_shape, links, model_config, to_hf

MAX_TOKENIZER_PATH = 4096  # characters: PATH_MAX on Linux


def _take(state: Mapping[str, Tensor], name: str, arch: str) -> Tensor:
    if name not in state:
        raise UserError(f"checkpoint has no parameter '{name}'; it does not hold a complete "
                        f"{'Llama' if arch == 'llama' else 'GPT'} model")
    return state[name]


def _check_shapes(state: Mapping[str, Tensor], m: Any, table: Mapping[str, Link]) -> None:
    """Every tensor has the shape the config says: a checkpoint whose config was edited is refused, not
    exported as a model that cannot run. Vocabulary rows need only cover vocab_size (the padding may differ)."""
    config = (f"the stored model config (layers={m.layers}, hidden={m.hidden}, heads={m.heads}, "
              f"kv_heads={m.kv_head_count}, ffn_hidden={m.ffn_hidden}, seq_len={m.seq_len})")
    for name, link in table.items():
        if name not in state:
            continue
        shape = tuple(state[name].shape)
        if link.kind == "vocab":
            if len(shape) != 2 or shape[1] != m.hidden or shape[0] < m.vocab_size:
                raise UserError(f"checkpoint parameter '{name}' has shape {shape}; {config} needs hidden={m.hidden} "
                                f"columns and at least model.vocab_size={m.vocab_size} rows")
        elif shape != link.shape:
            raise UserError(f"checkpoint parameter '{name}' has shape {shape}, {config} gives {link.shape}")
    extra = next((n for n in state if n.startswith(f"layers.{m.layers}.")), None)
    if extra is not None:
        raise UserError(f"checkpoint holds 'layers.{m.layers}.*', more layers than its model config's "
                        f"layers={m.layers}")


def to_hf_state_dict(state: Mapping[str, Tensor], model_cfg: Any,
                     special_ids: Optional[Mapping[str, Optional[int]]] = None) -> tuple[dict, dict[str, Tensor]]:
    """(config.json dict, HF state dict) from full tensors keyed by megazero's global names.

    ``model_cfg`` is a ModelConfig or the ``model`` section of a run's config as a dict; ``special_ids``
    the tokenizer's ``bos_token_id``/``eos_token_id`` (None: unknown).
    """
    m = model_config(model_cfg)
    table = links(m)
    _check_shapes(state, m, table)
    out = {link.hf: to_hf(_take(state, name, m.arch), link, m) for name, link in table.items()}
    dtype = _take(state, "embed.tokens.weight", m.arch).dtype
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
            "num_attention_heads": m.heads, "num_key_value_heads": m.kv_head_count, "head_dim": m.head_dim,
            "hidden_act": "silu", "max_position_embeddings": m.seq_len, "rms_norm_eps": float(m.norm_eps),
            "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta, **(scaling or {})},
            "rope_scaling": scaling, "attention_bias": bool(m.bias), "mlp_bias": bool(m.bias),
            "attention_dropout": 0.0, "pretraining_tp": 1, "use_cache": True}


def tokenizer_files(path: str | Path, arch: str, seq_len: int
                    ) -> tuple[dict[str, bytes], dict[str, Optional[int]], str]:
    """(files to write beside the weights, bos/eos ids for config.json, a note or "") for the run's tokenizer.

    A tokenizer.json is copied as is, named for ``PreTrainedTokenizerFast``. A sentencepiece model becomes
    tokenizer.model named for ``LlamaTokenizer`` (Llama only: transformers has no sentencepiece GPT-2
    tokenizer), told whether the model adds a leading "▁" (megazero trains without it), so both give the
    same ids. Neither adds BOS/EOS: megazero trained on documents joined by EOS alone.
    """
    import sentencepiece as spm

    from megazero.data.hf_tokenizer import EOS_NAMES, looks_like_tokenizer_json
    from megazero.data.tokenizer import Tokenizer

    path = Path(path)
    Tokenizer.load(path, "the checkpoint's tokenizer")  # checks the file: one line if it is not one
    data = path.read_bytes()
    common = {"model_max_length": seq_len, "add_bos_token": False, "add_eos_token": False}
    if looks_like_tokenizer_json(path):
        import tokenizers

        vocab = tokenizers.Tokenizer.from_str(data.decode("utf-8")).get_vocab(with_added_tokens=True)
        eos = next((name for name in EOS_NAMES if name in vocab), None)
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **common, **({"eos_token": eos} if eos else {})}
        ids = {"eos_token_id": vocab[eos] if eos else None}
        return {"tokenizer.json": data, "tokenizer_config.json": _json_bytes(config)}, ids, ""
    sp = spm.SentencePieceProcessor(model_file=str(path))
    numbers = {"bos": sp.bos_id(), "eos": sp.eos_id(), "unk": sp.unk_id()}  # -1: the model has none
    ids = {f"{kind}_token_id": i if i >= 0 else None for kind, i in numbers.items() if kind != "unk"}
    files = {"tokenizer.model": data}
    if arch != "llama":
        return files, ids, (f"tokenizer {path} is a sentencepiece model, copied as tokenizer.model; transformers has "
                            "no GPT-2 tokenizer for it: load it with sentencepiece")
    prefix = "".join(sp.encode_as_pieces("a")).startswith("\u2581")
    config = {"tokenizer_class": "LlamaTokenizer", **common, "add_prefix_space": prefix, "legacy": False,
              **{f"{kind}_token": sp.id_to_piece(i) for kind, i in numbers.items() if i >= 0}}
    return {**files, "tokenizer_config.json": _json_bytes(config)}, ids, ""


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def run_tokenizer(meta: Mapping[str, Any], where: Path, arch: str, seq_len: int
                  ) -> tuple[dict[str, bytes], dict[str, Optional[int]], str]:
    """The tokenizer a checkpoint's meta.json records (see :func:`tokenizer_files`); none, with a note,
    when it records none or the file is gone (the weights are still worth exporting)."""
    value = meta.get("tokenizer")
    if value is None:
        return {}, {}, f"checkpoint {where} records no tokenizer path (older checkpoints do not): the folder gets none"
    if (not isinstance(value, str) or not value or len(value) > MAX_TOKENIZER_PATH
            or any(ord(c) < 32 or ord(c) == 127 for c in value)):
        raise UserError(f"checkpoint {where}: tokenizer={shown(value)} is invalid; expected the path of the run's "
                        f"tokenizer file")
    try:
        exists = Path(value).is_file()
    except OSError:
        exists = False
    if not exists:
        return {}, {}, f"the run's tokenizer {value} is no longer there: none exported"
    return tokenizer_files(value, arch, seq_len)


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
                    force: bool = False, extra_files: Optional[Mapping[str, bytes]] = None) -> Path:
    """Write config.json, the weights (model.safetensors when safetensors is installed) and ``extra_files``
    (name -> bytes: the tokenizer), all or nothing."""
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
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
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
    """Read a megazero checkpoint and write it, with its tokenizer, as a Hugging Face folder in ``out_dir``."""
    ckpt = Path(checkpoint_dir)
    if not ckpt.is_dir():
        raise UserError(f"checkpoint directory '{ckpt}' does not exist")
    check_output(Path(out_dir), force, keep=ckpt)  # before the (long) read
    from megazero.checkpoint.store import read_meta, read_model_state

    meta = read_meta(ckpt, require=("config",))  # checked: the model section obeys the config rules
    m = model_config(meta["config"]["model"])
    files, ids, note = run_tokenizer(meta, ckpt, m.arch, m.seq_len)
    if note:
        print(f"note: {note}")
    hf_config, hf_state = to_hf_state_dict(read_model_state(ckpt), m, ids)
    return write_hf_folder(out_dir, hf_config, hf_state, force, files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megazero.export",
        description="Write a megazero checkpoint as a Hugging Face folder (GPT2LMHeadModel or "
                    "LlamaForCausalLM) with its tokenizer.",
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

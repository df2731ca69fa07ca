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
    if m.spec.hf.zero_biases and not m.bias:  # HF's GPT-2 always adds biases: zeros compute the same
        full = links(dataclasses.replace(m, bias=True))
        out.update({link.hf: torch.zeros(hf_shape(link, m), dtype=dtype) for name, link in full.items()
                    if name not in table})
    out = {k: v.detach().cpu().contiguous().clone() for k, v in out.items()}
    ids = {"bos_token_id": None, "eos_token_id": None, **(special_ids or {})}
    config = m.spec.hf.config(m, kind)
    config.update(architectures=[HF_ARCHITECTURES[kind]], model_type=kind, vocab_size=m.vocab_size,
                  initializer_range=float(m.init_std), tie_word_embeddings=bool(m.tie_embeddings),
                  torch_dtype=str(dtype).removeprefix("torch."), **ids)
    return config, out


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

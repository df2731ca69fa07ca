"""An export accounts for every stored tensor: the checkpoint's tensors and its meta.json's model config agree.

The config decides what an export writes, so a meta.json edited after the save would drop trained weights
without a word: ``tie_embeddings: true`` over an untied model drops the trained head, ``bias: false`` over
GPT-2 writes zero biases in place of the trained ones, fewer ``layers`` drop the layers beyond, a smaller
``vocab_size`` cuts embedding rows. So each stored tensor must be one the config uses (a stored tensor it
does not use is refused by name), each tensor it uses must be stored, with the shape it gives, and the
vocabulary rows must lie between ``vocab_size`` and its padding (the rows the tokenizer uses are checked
against the tokenizer itself, in ``megazero.interop.export_tokenizer``).

Shapes are all it needs, so a checkpoint is checked from its metadata before any tensor is read.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from megazero.errors import UserError
from megazero.interop.hf_layout import Link

_LAYER = re.compile(r"layers\.([0-9]+)\.")


def _summary(m: Any) -> str:
    moe = f", moe.experts={m.moe.experts}" if m.moe.experts else ""
    return (f"its model config (arch={m.arch}, layers={m.layers}, hidden={m.hidden}, heads={m.heads}, "
            f"kv_heads={m.kv_head_count}, ffn_hidden={m.ffn_hidden}, seq_len={m.seq_len}, vocab_size={m.vocab_size}, "
            f"bias={str(bool(m.bias)).lower()}, tie_embeddings={str(bool(m.tie_embeddings)).lower()}{moe})")


def _unused_reason(name: str, m: Any) -> str:
    """Which key of the config leaves ``name`` out, as the user would edit it back."""
    layer = _LAYER.match(name)
    if layer and int(layer.group(1)) >= m.layers:
        return f"more layers than its model config's layers={m.layers}"
    if name == "head.weight" and m.tie_embeddings:
        return "model.tie_embeddings=true (the output head is the token embedding there)"
    if name.endswith(".bias") and not m.bias:
        return "model.bias=false"
    if layer and ".mlp." in name and m.moe.experts:
        i = int(layer.group(1))
        what = "a mixture of experts" if m.moe.is_moe_layer(i) else "dense"
        return f"model.moe (layer {i} is {what} there)"
    if ".attn.q_norm." in name or ".attn.k_norm." in name:
        return "model.qk_norm=false"
    if name == "embed.positions.weight" and not m.spec.learned_positions:
        return f"model.arch={m.arch} (rotary positions, no position table)"
    return f"model.arch={m.arch}"


def check_tensors(shapes: Mapping[str, tuple[int, ...]], m: Any, table: Mapping[str, Link],
                  where: str = "checkpoint") -> None:
    """Stored tensor names -> shapes against the resolved config ``m`` and its :func:`links` table; one line
    naming the first tensor that is unused, missing, misshapen or has rows beyond the padded vocabulary.

    ``where`` names the checkpoint in the message."""
    unused = [name for name in shapes if name not in table]
    if unused:
        name = unused[0]
        more = f" ({len(unused)} such tensors)" if len(unused) > 1 else ""
        raise UserError(f"{where} holds '{name}'{more}, which {_summary(m)} does not use: "
                        f"{_unused_reason(name, m)}; exporting would drop trained weights, so its meta.json does not "
                        f"describe these tensors (restore the model section it was saved with)")
    missing = [name for name in table if name not in shapes]
    if missing:
        more = f" ({len(missing)} missing)" if len(missing) > 1 else ""
        raise UserError(f"{where} has no tensor '{missing[0]}'{more}, which {_summary(m)} needs: it does not hold "
                        f"a complete {m.spec.model_name} model of that config")
    for name, link in table.items():
        shape = tuple(shapes[name])
        if link.kind == "vocab":
            _check_vocab(name, shape, m, where)
        elif shape != link.shape:
            raise UserError(f"{where}: tensor '{name}' has shape {shape}, {_summary(m)} gives {link.shape}")


def _check_vocab(name: str, shape: tuple[int, ...], m: Any, where: str) -> None:
    """Rows from vocab_size up to its padding are never trained on (a checkpoint of another padding may have
    fewer); rows beyond the padding are not padding: the config's vocab_size was cut."""
    if len(shape) != 2 or shape[1] != m.hidden or shape[0] < m.vocab_size:
        raise UserError(f"{where}: tensor '{name}' has shape {shape}; {_summary(m)} needs hidden={m.hidden} "
                        f"columns and at least model.vocab_size={m.vocab_size} rows")
    if shape[0] > m.padded_vocab:
        raise UserError(f"{where}: tensor '{name}' has {shape[0]} rows, beyond the {m.padded_vocab} of "
                        f"model.vocab_size={m.vocab_size} padded to a multiple of {m.vocab_pad_multiple}: the rows "
                        f"past it would be dropped, so its meta.json does not describe these tensors (restore the "
                        f"vocab_size it was saved with)")

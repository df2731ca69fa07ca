"""The run's tokenizer, exported beside the weights so ``AutoTokenizer`` gives the ids the model was trained on.

The checkpoint's meta.json records the tokenizer's path. It is read through ``megazero.data`` (the one loader:
a file that is no tokenizer, or that the tokenizers library cannot parse, is one line naming it) and checked
against the model's vocabulary by the rule ``data.tokenizer`` obeys at training
(``megazero.data.cache_plan.check_tokenizer``): a tokenizer with more pieces than ``model.vocab_size`` would
use rows the export cuts. Where meta.json records the file's content fingerprint (``tokenizer_fingerprint``,
written at save), the bytes read must match it: a file replaced at that path by another tokenizer would give
the exported model ids it was not trained on, so it is refused rather than shipped.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from megazero.errors import UserError, shown

MAX_TOKENIZER_PATH = 4096  # characters: PATH_MAX on Linux


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def tokenizer_files(path: str | Path, sentencepiece_class: Optional[str], seq_len: int, vocab_size: int,
                    what: str = "tokenizer",
                    fingerprint: Optional[str] = None) -> tuple[dict[str, bytes], dict[str, Optional[int]], str]:
    """(files to write beside the weights, bos/eos ids for config.json, a note or "") for the run's tokenizer.

    A tokenizer.json is copied as is, named for ``PreTrainedTokenizerFast``. A sentencepiece model becomes
    tokenizer.model named for ``sentencepiece_class`` (the architecture's spec's ``hf.tokenizer_class``: Llama's
    ``LlamaTokenizer``; None for GPT-2: transformers has no sentencepiece GPT-2 tokenizer), told whether the model
    adds a leading "▁" (megazero trains without it), so both give the same ids. Neither adds BOS/EOS: megazero
    trained on documents joined by EOS alone. ``what`` names where the path came from, for messages.
    ``fingerprint``: the content fingerprint the file must have (``megazero.data.cache_plan.content_fingerprint``),
    None to take the file as it is.
    """
    import sentencepiece as spm

    from megazero.data.cache_plan import check_tokenizer
    from megazero.data.hf_tokenizer import EOS_NAMES, looks_like_tokenizer_json, parse_tokenizer_json, vocabulary
    from megazero.data.tokenizer import HFTokenizer, SentencePieceTokenizer, read_tokenizer_file

    path = Path(path)
    # read once, bounded and only from a regular file; parsed from these bytes, which are also what is written
    data = read_tokenizer_file(path, what)
    ours = hashlib.sha256(data).hexdigest()[:16]  # = content_fingerprint(path), of the bytes that are written
    if fingerprint is not None and ours != fingerprint.lower():
        raise UserError(f"{what} {path} has changed since the checkpoint was saved (content {ours} now, "
                        f"{fingerprint} recorded): its token ids would not be the ones the model was trained on; "
                        f"put the run's tokenizer file back at that path")
    common = {"model_max_length": seq_len, "add_bos_token": False, "add_eos_token": False}
    if looks_like_tokenizer_json(path, data):
        parsed = parse_tokenizer_json(data, path, what)  # one line for a file the library cannot parse
        check_tokenizer(HFTokenizer(parsed, path, what), vocab_size, tokenises=False)
        vocab = vocabulary(parsed, f"{what} {path}")
        eos = next((name for name in EOS_NAMES if name in vocab), None)
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **common, **({"eos_token": eos} if eos else {})}
        ids = {"eos_token_id": vocab[eos] if eos else None}
        return {"tokenizer.json": data, "tokenizer_config.json": _json_bytes(config)}, ids, ""
    check_tokenizer(SentencePieceTokenizer.parse(data, path, what), vocab_size, tokenises=False)
    sp = spm.SentencePieceProcessor(model_proto=data)
    numbers = {"bos": sp.bos_id(), "eos": sp.eos_id(), "unk": sp.unk_id()}  # -1: the model has none
    ids = {f"{kind}_token_id": i if i >= 0 else None for kind, i in numbers.items() if kind != "unk"}
    files = {"tokenizer.model": data}
    if sentencepiece_class is None:
        return files, ids, (f"tokenizer {path} is a sentencepiece model, copied as tokenizer.model; transformers has "
                            "no GPT-2 tokenizer for it: load it with sentencepiece")
    prefix = "".join(sp.encode_as_pieces("a")).startswith("\u2581")
    config = {"tokenizer_class": sentencepiece_class, **common, "add_prefix_space": prefix, "legacy": False,
              **{f"{kind}_token": sp.id_to_piece(i) for kind, i in numbers.items() if i >= 0}}
    return {**files, "tokenizer_config.json": _json_bytes(config)}, ids, ""


def run_tokenizer(meta: Mapping[str, Any], where: Path, m: Any
                  ) -> tuple[dict[str, bytes], dict[str, Optional[int]], str]:
    """The tokenizer a checkpoint's meta.json records, for the resolved model config ``m`` (see
    :func:`tokenizer_files`); none, with a note, when it records none or the file is gone (the weights are
    still worth exporting)."""
    value = meta.get("tokenizer")
    if value is None:
        return {}, {}, f"checkpoint {where} records no tokenizer path (older checkpoints do not): the folder gets none"
    if (not isinstance(value, str) or not value or len(value) > MAX_TOKENIZER_PATH
            or any(ord(c) < 32 or ord(c) == 127 for c in value)):
        raise UserError(f"checkpoint {where}: tokenizer={shown(value)} is invalid; expected the path of the run's "
                        f"tokenizer file")
    try:
        exists = Path(value).exists()  # something in its place that is no file: named, not skipped
    except OSError:
        exists = False
    if not exists:
        return {}, {}, f"the run's tokenizer {value} is no longer there: none exported"
    try:
        return tokenizer_files(value, m.spec.hf.tokenizer_class, m.seq_len, m.vocab_size, "data.tokenizer",
                               meta.get("tokenizer_fingerprint"))
    except UserError as e:
        raise UserError(f"checkpoint {where}: {e}") from None

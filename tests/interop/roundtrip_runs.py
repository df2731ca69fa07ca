"""test_hf_roundtrip.py's training, in a module of its own: a spawned rank imports the module of the function it
runs, and the test's module imports transformers (seconds on each of the eight ranks, which train without it)."""
from __future__ import annotations

from pathlib import Path

from tests.runs import ROOT, small_overrides

CONFIG = str(ROOT / "configs" / "tiny.yaml")
VOCAB, SEQ, STEPS = 512, 32, 5
LAYOUT = {"parallel.tp": 2, "parallel.pp": 2, "parallel.sequence_parallel": "true", "zero.stage": 1}
# megazero's keys for each model transformers builds (test_hf_roundtrip.MODELS)
KEYS = {"llama": {"model.arch": "llama", "model.kv_heads": 2, "model.ffn_hidden": 128, "model.norm_eps": 1e-5},
        "gpt2": {"model.arch": "gpt2"}}


def overrides(text: Path, cache: Path, base: Path, name: str) -> list[str]:
    """The run that starts from the Hugging Face folder base/hf_<name>, with the tokenizer base/tokenizer.json."""
    return small_overrides(text, cache, base / name, steps=STEPS, **LAYOUT, **KEYS[name], **{
        "model.layers": 4, "model.hidden": 64, "model.heads": 4, "model.seq_len": SEQ, "model.vocab_size": VOCAB,
        "train.init_from": str(base / f"hf_{name}"), "data.tokenizer": str(base / "tokenizer.json")})


def train(rank: int, world: int, text: Path, cache: Path, base: Path) -> bool:
    """Every model's run, on each of the spawn's ranks."""
    from megazero.train.run import run

    for name in KEYS:
        run(CONFIG, overrides(text, cache, base, name))
    return True

"""megazero's side of tests/interop/test_hf_moe.py's runs: the keys of the tiny Mixtral and Qwen3-MoE, and what
each spawned rank runs. Its own module so the 8 ranks import megazero alone, not transformers (~9 s a process
here, 8 of them taking turns on two cores)."""
from __future__ import annotations

from tests.runs import ROOT, small_overrides

CONFIG = str(ROOT / "configs" / "tiny.yaml")
VOCAB, SEQ, STEPS, HIDDEN, LAYERS = 512, 32, 3, 64, 4
LAYOUT = {"parallel.tp": 2, "parallel.pp": 2, "parallel.ep": 2, "parallel.sequence_parallel": "true",
          "zero.stage": 1}
ONE = {"parallel.tp": 1, "parallel.pp": 1, "parallel.ep": 1}
MOE = {"model.arch": "llama", "model.layers": LAYERS, "model.hidden": HIDDEN, "model.heads": 4, "model.kv_heads": 2,
       "model.seq_len": SEQ, "model.vocab_size": VOCAB, "model.tie_embeddings": "false", "model.moe.experts": 4,
       "model.moe.top_k": 2}
KEYS = {  # each folder's model in megazero's keys, beside MOE
    "mixtral": {"model.ffn_hidden": 32, "model.rope_theta": 1.0e6, "model.norm_eps": 1.0e-5},
    "qwen3_moe": {"model.qk_norm": "true", "model.ffn_hidden": 96, "model.moe.expert_hidden": 32,
                  "model.moe.dense_layers": 1, "model.moe.norm_topk_prob": "false", "model.norm_eps": 1.0e-6},
}


def keys(name: str) -> dict:
    return {**MOE, **KEYS[name]}


def overrides(base, name: str, layout: dict, log: str) -> list[str]:
    """The run importing ``base/hf_NAME`` at ``layout``, logging to ``base/log``."""
    return small_overrides(base / "text", base / "cache", base / log, steps=STEPS, **layout, **keys(name), **{
        "train.global_batch": 4, "train.micro_batch": 1,  # two microbatches per dp rank: 1F1B's steady state
        "train.init_from": str(base / f"hf_{name}"), "data.tokenizer": str(base / "tokenizer.json")})


def train_layout(rank, world, base) -> bool:
    """On every rank: both imports at LAYOUT (tp2 x ep2 x pp2, dp 2)."""
    from megazero.train.run import run

    for name in KEYS:
        run(CONFIG, overrides(base, name, LAYOUT, name))
    return True

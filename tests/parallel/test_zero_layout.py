"""ZeRO reads the model through its declarations: sharding units and tied parameters, never parameter names.

The buckets it cuts from them are the ones it cut when it read the names (recorded in
``tests/parallel/zero_buckets.json``: names and order, deferred, chunk, per-layer unit, the runs counted in the
gradient norm), for a GPT-2 tied across pp=2 (one and two model chunks per rank), a Llama and a GPT-2 on one
stage, at ZeRO-0 (size buckets) and ZeRO-3 (per-layer buckets).
"""

import json
import re
from pathlib import Path

import torch

from megazero.config.schema import ModelConfig
from megazero.models.block import Block
from megazero.models.build import build_gpt
from megazero.parallel.zero.layout import BucketLayout
from megazero.parallel.zero.policy import StagePolicy

ROOT = Path(__file__).resolve().parents[2]
GPT2 = dict(layers=4, hidden=64, heads=4, seq_len=32, vocab_size=300, ffn_hidden=256)
LLAMA = dict(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=512, seq_len=32)


def stage(cfg: dict, layers: range, first: bool, last: bool):
    return build_gpt(ModelConfig(**cfg), 0, layer_ids=layers, first_stage=first, last_stage=last)


def layouts() -> dict:
    """Each layout's model chunks on one rank, by the recorded name."""
    return {
        "gpt2_pp2/first": [stage(GPT2, range(0, 2), True, False)],
        "gpt2_pp2/last": [stage(GPT2, range(2, 4), False, True)],
        # pp=2 with two virtual stages: rank 0 holds virtual stages 0 and 2, rank 1 stages 1 and 3 (the last)
        "gpt2_pp2_v2/rank0": [stage(GPT2, range(0, 1), True, False), stage(GPT2, range(2, 3), False, False)],
        "gpt2_pp2_v2/rank1": [stage(GPT2, range(1, 2), False, False), stage(GPT2, range(3, 4), False, True)],
        "llama/one": [stage(LLAMA, range(0, 2), True, True)],
        "gpt2_one/one": [stage(GPT2, range(0, 4), True, True)],
    }


def test_a_stage_declares_its_sharding_units_and_tied_parameters():
    first, last = layouts()["gpt2_pp2/first"][0], layouts()["gpt2_pp2/last"][0]
    assert [n for n, _ in first.sharding_units()] == ["layers.0", "layers.1"]
    assert [n for n, _ in last.sharding_units()] == ["layers.2", "layers.3"]
    assert all(m is last.layers[n.split(".")[1]] for n, m in last.sharding_units())
    # GPT-2 across pp=2: both ends hold the token embedding; the first stage's copy counts toward the norm
    (name, p, counted), = first.tied_parameters()
    assert (name, p, counted) == ("embed.tokens.weight", first.embed.tokens.weight, True)
    (name, p, counted), = last.tied_parameters()
    assert (name, p, counted) == ("embed.tokens.weight", last.embed.tokens.weight, False)
    assert dict(last.named_parameters())[name] is p
    llama = layouts()["llama/one"][0]
    assert [n for n, _ in llama.sharding_units()] == ["layers.0", "layers.1"] and llama.tied_parameters() == []
    assert {type(m) for _, m in llama.sharding_units() + first.sharding_units()} == {Block}  # one block for both
    whole = layouts()["gpt2_one/one"][0]  # tied, but to itself: nothing to sum
    assert len(whole.sharding_units()) == 4 and whole.tied_parameters() == []


def test_buckets_are_the_ones_recorded_when_zero_read_names():
    recorded = json.loads((ROOT / "tests" / "parallel" / "zero_buckets.json").read_text())
    got = {}
    for name, chunks in layouts().items():
        for zero in (0, 3):
            layout = BucketLayout(chunks, StagePolicy.of(zero), 2, 0, torch.float32, torch.float32, 0.05,
                                  torch.device("cpu"))
            got[f"{name}/zero{zero}"] = [
                [[n for n, _ in b.params], b.deferred, b.chunk, b.unit is not None,
                 [list(run) for run in layout.mask_runs(b, 0)[1]]]
                for b in layout.buckets]
    assert got.keys() == recorded.keys()
    for key in recorded:
        assert got[key] == recorded[key], key


def test_parallel_zero_names_no_parameter_and_reaches_into_no_model_attribute():
    pattern = re.compile(r"\"(embed|layers|head|final_norm|tokens)[.\"]|'(embed|layers)|chunk\.layers|\.layers\b"
                         r"|tied_copy|embed\.tokens")
    hits = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
            for path in sorted((ROOT / "parallel" / "zero").glob("*.py"))
            for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, "\n".join(hits)

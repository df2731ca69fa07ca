"""Context parallelism divides a layer's activations: at cp 4 the bytes one Llama block keeps for backward
(measured by the memory tracker on real CPU tensors) are 1/4 of cp 1's, within 10% (the issue's bound).

What stays whole is tiny next to the rest: the rotary tables of a rank's positions scale with s/cp as well;
only the ring's received K/V are extra, and they are freed before the block returns (measured ratio ~0.25).
"""
from __future__ import annotations

import torch

from megazero.config.load import load_config
from megazero.plan.tracker import MemoryTracker
from megazero.models.build import build_gpt
from megazero.parallel.sequence import SequenceSplit
from tests.dist import run_ranks
from tests.runs import ROOT

SEQ, BATCH = 256, 2
SETS = ["parallel.pp=1", "parallel.tp=1", "parallel.sequence_parallel=false", "model.layers=1", "model.hidden=64", "model.heads=8", "model.kv_heads=2", "model.ffn_hidden=128",
        f"model.seq_len={SEQ}", "model.vocab_size=256", "model.dropout=0.0"]


def _kept_bytes(cp_comm=None) -> int:
    """Bytes the block's forward leaves alive for backward, on this rank (its input and weights excluded)."""
    from megazero.parallel.comm import Comm

    cp = cp_comm if cp_comm is not None else Comm(None, "cp")
    cfg = load_config(ROOT / "configs" / "tiny-llama.yaml", SETS).model
    block = build_gpt(cfg, 3, cp=cp, first_stage=False, last_stage=False, layer_ids=range(1))
    rows = torch.zeros(BATCH, SEQ + 1, dtype=torch.long)
    _, _, info = SequenceSplit(cp)(rows, torch.device("cpu"))
    x = torch.randn(BATCH, SEQ // cp.size, cfg.hidden, requires_grad=True)
    tracker = MemoryTracker()
    with tracker:
        tracker.name([x, *block.parameters()], "params")  # there before the forward: not its activations
        before = tracker.device_bytes
        y = block(x, info=info)
        kept = tracker.device_bytes - before - y.numel() * y.element_size()  # what backward holds but the output
    y.sum().backward()
    return kept


def _four(rank, world):
    import torch.distributed as dist

    from megazero.parallel.comm import Comm

    return _kept_bytes(Comm(dist.group.WORLD, "cp"))


def test_cp4_keeps_a_quarter_of_the_activations():
    one = _kept_bytes()
    four = run_ranks(4, _four)
    assert one > 0
    for kept in four:
        assert abs(kept / one - 0.25) <= 0.10 * 0.25, (kept, one, kept / one)

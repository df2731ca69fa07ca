"""pretrain.py --simulate with many experts: building the experts on fake tensors takes a few ops whatever their
count (it drew each expert from its own generator, 3 ops an expert: 65,536 experts never finished), with the
same bytes seen; on real tensors every expert keeps its value drawn by its own name."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Ops(TorchDispatchMode):
    """Counts the ops dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _cfg(experts: int):
    from megazero.config.load import load_config
    from megazero.config.resolve import resolve

    return resolve(load_config(None, ["model.arch=llama", "model.layers=2", "model.hidden=32", "model.heads=2",
                                      "model.seq_len=16", "model.vocab_size=128", f"model.moe.experts={experts}",
                                      "model.moe.top_k=2", "model.moe.expert_hidden=16", "parallel.dp=1"]),
                   1, "cpu")


def _fake_build(experts: int) -> tuple[int, int]:
    """Ops dispatched and the most bytes alive (the tracker's build peak) building the model on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megazero.plan.tracker import MemoryTracker
    from models.build import build_gpt

    counter, tracker = _Ops(), MemoryTracker()
    with FakeTensorMode(allow_non_fake_inputs=True), tracker, counter:
        build_gpt(_cfg(experts).model, 1234)
    return counter.ops, tracker.report().peak_bytes


def test_fake_experts_are_built_in_ops_independent_of_their_count():
    """8 and 1024 experts a layer: the same ops; the peak grows by the experts' bytes, their stack and its draw
    alive at once (fp32: 2 x 4 B x 3 matrices x 16 x 32 an expert), as drawing each did."""
    few, few_peak = _fake_build(8)
    many, many_peak = _fake_build(1024)
    assert few == many, (few, many)
    assert many_peak - few_peak >= 2 * 4 * 3 * 16 * 32 * (1024 - 8), (few_peak, many_peak)


def test_real_experts_are_each_drawn_by_their_own_name():
    """Real tensors: expert e of a stacked parameter is initial_value of its logical name, bit for bit (what
    layout invariance and an import rely on)."""
    from models.build import build_gpt
    from models.init import expert_name, initial_value

    cfg = _cfg(8)
    model = build_gpt(cfg.model, 1234)
    stacked = [(n, p) for n, p in model.named_parameters() if getattr(p, "ep_split_dim", None) is not None]
    assert stacked
    for name, p in stacked:
        for e in (0, 5):
            want = initial_value(expert_name(name, e), tuple(p.shape[1:]), 1234, cfg.model)
            assert torch.equal(p.detach()[e], want.to(p.dtype)), (name, e)

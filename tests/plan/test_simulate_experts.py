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
    from megazero.models.build import build_gpt

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
    from megazero.models.build import build_gpt
    from megazero.models.init import expert_name, initial_value

    cfg = _cfg(8)
    model = build_gpt(cfg.model, 1234)
    stacked = [(n, p) for n, p in model.named_parameters() if getattr(p, "ep_split_dim", None) is not None]
    assert stacked
    for name, p in stacked:
        for e in (0, 5):
            want = initial_value(expert_name(name, e), tuple(p.shape[1:]), 1234, cfg.model)
            assert torch.equal(p.detach()[e], want.to(p.dtype)), (name, e)


def _moe(local: int):
    """2 layers (a dense one, a mixture of ``local`` experts per ep rank), ep 2 of dp 2: each ep rank's experts
    receive 2 x 32 x 2 = 128 rows a microbatch."""
    from megazero.config.load import load_config
    from megazero.config.resolve import resolve

    return resolve(load_config(None, ["model.arch=llama", "model.layers=2", "model.hidden=64", "model.heads=4",
                                      "model.kv_heads=2", "model.seq_len=32", "model.vocab_size=256",
                                      f"model.moe.experts={2 * local}", "model.moe.top_k=2",
                                      "model.moe.expert_hidden=32", "model.moe.dense_layers=1",
                                      "parallel.dp=2", "parallel.ep=2", "train.micro_batch=2",
                                      "train.global_batch=8", "train.precision=bf16"]), 2, "cpu")


def _compare(local: int, counts: list[int]) -> None:
    """The expert axis at ``counts``, and every figure within TOLERANCE of the peak (of itself for the bytes
    sent) of simulating every expert: the increments per expert are constant along one dispatch path."""
    from megazero.plan.axes import EXPERTS, choose_axes
    from megazero.plan.extrapolate import TOLERANCE, figures, simulate_class
    from megazero.plan.simulate import simulate_rank
    from megazero.plan.stage_plan import make_plan

    cfg = _moe(local)
    plan = make_plan(cfg)
    axes = choose_axes(cfg, 0)
    assert [(a.kind, [a.count(x) for x in (0, 1, 2, a.real)]) for a in axes] == [(EXPERTS, counts + [local])]
    said: list[str] = []
    got, want = simulate_class(cfg, 0, plan, said.append), simulate_rank(cfg, 0, plan)
    assert said == [] and got.extrapolated.startswith(f"extrapolated linearly from {counts[0]}, {counts[1]} and "
                                                      f"{counts[2]} routed experts per ep rank to {local}"), said
    assert got.moment == want.moment
    g, w = figures(got), figures(want)
    assert g.keys() == w.keys()
    for k in g:
        scale = abs(w[k]) if k.startswith("comm_bytes.") else w["peak_bytes"]
        assert abs(g[k] - w[k]) <= TOLERANCE * scale, (k, g[k], w[k])


def test_uneven_experts_are_extrapolated_from_counts_that_do_not_divide_the_rows():
    """12 experts a rank do not divide 128 rows: simulated at 5, 6 and 7 (not 2 to 4, which divide them)."""
    _compare(12, [5, 6, 7])


def test_even_experts_are_extrapolated_from_counts_that_divide_the_rows():
    """16 experts a rank divide 128 rows: simulated at 2, 4 and 8, each dividing them too."""
    _compare(16, [2, 4, 8])

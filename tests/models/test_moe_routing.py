"""Routing's edge cases through the real dispatch at ep 4, balancing, and the one-line refusals.

Edge cases (each against the same layer on one process, forward and backward, fp32; tolerance 1e-5 relative:
only the grouping of the matmuls' rows differs): every token of one rank routed to one expert; an expert
that no token reaches; top_k = E (every token to every expert).
"""
from __future__ import annotations

import pytest
import torch

from megazero.config.load import load_config
from tests.dist import run_ranks
from tests.hostile import assert_one_line, pretrain_main
from tests.runs import ROOT

LLAMA = str(ROOT / "configs" / "tiny-llama.yaml")
BASE = ["model.layers=2", "model.hidden=32", "model.heads=4", "model.kv_heads=2", "model.ffn_hidden=64",
        "model.seq_len=16", "model.vocab_size=256", "model.moe.experts=8", "model.moe.expert_hidden=16",
        "parallel.tp=1", "parallel.pp=1", "parallel.sequence_parallel=false"]


def _layer(top_k: int, ep, bias: torch.Tensor | None = None, capacity: float = 0.0):
    """The MoE MLP of layer 0 with this ep group's share of the experts, values independent of the split."""
    from megazero.models.init import initial_tp_value
    from megazero.models.moe import MoE
    from megazero.models.split import Split
    from megazero.models.stage import mark_replicated
    from megazero.parallel.tp_random import TPRandom

    cfg = load_config(LLAMA, BASE + [f"model.moe.top_k={top_k}", f"model.moe.capacity_factor={capacity}"]).model
    layer = MoE(cfg, Split(None, False, TPRandom(), ep=ep))

    class Holder(torch.nn.Module):  # initial values are drawn by global name, as in a stage
        def __init__(self):
            super().__init__()
            self.cfg = cfg
            self.layers = torch.nn.ModuleDict({"0": torch.nn.Module()})
            self.layers["0"].mlp = layer

    holder = Holder()
    mark_replicated(holder)
    with torch.no_grad():
        for name, p in holder.named_parameters():
            p.copy_(initial_tp_value(holder, name, 7))
    if bias is not None:  # steer the router through feature 0, which every token holds at ~5 (_tokens)
        layer.router.weight.data[:, 0] += bias
    return layer


def _tokens(rank: int, case: str) -> torch.Tensor:
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(100 + rank))
    x[..., 0] += 5.0
    return x


def _steer(case: str) -> torch.Tensor | None:
    if case == "one_expert":  # every token to expert 5 (and its second choice)
        return torch.tensor([0, 0, 0, 0, 0, 40.0, 0, 0])
    if case == "idle_expert":  # expert 2 never chosen
        return torch.tensor([0, 0, -40.0, 0, 0, 0, 0, 0])
    if case == "capacity":  # every token to experts 5 and 6
        return torch.tensor([0, 0, 0, 0, 0, 40.0, 40.0, 0])
    return None


# Capacity factor 1 over a rank's 32 tokens, top 2 of 8: each expert takes ceil(32 * 2 / 8) = 8 copies, so
# experts 5 and 6 drop 24 each, 48 a rank. Dropping depends on the layout in general (the capacity is of the
# tokens one rank routes at once: tp, cp and the microbatch change it); this steer makes it linear in the
# tokens, so one process routing the 4 ranks' 128 tokens at once (capacity 32) drops the same 4 x 48.
CAPACITY, DROPPED_PER_RANK = 1.0, 48


def _run_case(layer, xs: list[torch.Tensor]):
    outs, grads = [], {}
    for x in xs:
        x = x.clone().requires_grad_()
        y = layer(x)
        (y * torch.arange(y.numel()).view_as(y).sin()).sum().backward()
        outs.append((y.detach(), x.grad))
    for n, p in layer.named_parameters():
        grads[n] = p.grad.clone()
    return outs, grads


def _edge_cases(rank, world):
    from megazero.parallel.topology import Grid
    from megazero.parallel.dims import ParallelDims

    grid = Grid.build(ParallelDims(tp=1, ep=world, pp=1, dp=world))
    results = {}
    for case, top_k in (("one_expert", 2), ("idle_expert", 2), ("all_experts", 8)):
        layer = _layer(top_k, grid.ep_comm, _steer(case))
        # the steer is in the router every rank shares: every rank's tokens are steered the same way
        outs, grads = _run_case(layer, [_tokens(rank, case)])
        results[case] = ([(y.numpy(), g.numpy()) for y, g in outs],
                         {n: g.numpy() for n, g in grads.items()}, layer.experts.first)
    layer = _layer(2, grid.ep_comm, _steer("capacity"), CAPACITY)
    _run_case(layer, [_tokens(rank, "capacity")])
    results["capacity"] = layer.stats.clone().numpy()
    return results


def test_routing_edge_cases_through_the_ep4_dispatch():
    from megazero.parallel.comm import Comm

    ranks = run_ranks(4, _edge_cases)
    for case, top_k in (("one_expert", 2), ("idle_expert", 2), ("all_experts", 8)):
        one = _layer(top_k, Comm(None, "ep"), _steer(case))
        outs, grads = _run_case(one, [_tokens(r, case) for r in range(4)])
        for r in range(4):
            y, gx = ranks[r][case][0][0]
            torch.testing.assert_close(torch.tensor(y), outs[r][0], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(torch.tensor(gx), outs[r][1], rtol=1e-5, atol=1e-6)
        # expert gradients: each rank holds 2 experts; summed over the 4 ranks' tokens they are the
        # single process's (which saw all four ranks' tokens)
        for kind in ("experts.gate", "experts.up", "experts.down"):
            mine = torch.cat([torch.tensor(ranks[r][case][1][kind]) for r in range(4)])
            torch.testing.assert_close(mine, grads[kind], rtol=1e-5, atol=1e-7)
        router = sum(torch.tensor(ranks[r][case][1]["router.weight"]) for r in range(4))
        torch.testing.assert_close(router, grads["router.weight"], rtol=1e-5, atol=1e-7)
        if case == "idle_expert":
            assert float(grads["experts.gate"][2].abs().sum()) == 0.0  # no token reached it
        if case == "one_expert":
            assert float(grads["experts.gate"][5].abs().sum()) > 0
    _check_dropped([torch.tensor(ranks[r]["capacity"]) for r in range(4)])


def _check_dropped(per_rank: list[torch.Tensor]) -> None:
    """The capacity case at ep 4 drops 48 copies on each rank, and so does one process (ep 1) given all four
    ranks' tokens at once; the step's router record publishes the global count and its share."""
    from megazero.engine.routers import RouterStats, router_record
    from megazero.models.moe import STATS
    from megazero.parallel.comm import Comm

    where = 8 + STATS.index("dropped")
    assert [float(t[where]) for t in per_rank] == [DROPPED_PER_RANK] * 4
    one = _layer(2, Comm(None, "ep"), _steer("capacity"), CAPACITY)
    _run_case(one, [torch.cat([_tokens(r, "capacity") for r in range(4)])])
    assert float(one.stats[where]) == 4 * DROPPED_PER_RANK
    row = torch.cat([sum(per_rank), torch.tensor([4.0, 0.0, 0.0], dtype=torch.float64)])
    record = router_record(RouterStats([1], row[None], capacity=True))
    assert record["moe/1/dropped_copies"] == 4 * DROPPED_PER_RANK
    assert record["moe/1/dropped"] == 4 * DROPPED_PER_RANK / (4 * 32 * 2)


def test_the_bias_balances_a_router_that_favours_two_experts(tmp_path):
    """DeepSeek-V3's auxiliary-loss-free balancing: a sigmoid router whose weights favour experts 0 and 1 (their
    rows tilted by a unit vector along the mean router input of a probe batch: every token's affinity to them
    raised, the bias untouched at 0) sends them 2.45x the mean load, the two largest; the bias update
    (DeepSeek-V3's rate, 0.001 per step) brings max/mean below 1.3 within 150 steps (measured: step 92) and
    keeps it there to step 220 (measured: at most 1.22) while the router trains and keeps its tilt. 1,024 tokens
    a step: a balanced router's max/mean is ~1.1 by chance alone (8 experts, 256 copies each on average)."""
    from megazero.config.resolve import resolve
    from megazero.engine.build import build_engine
    from megazero.engine.step import train_step
    from megazero.parallel.topology import Grid

    cfg = load_config(LLAMA, BASE + ["model.moe.top_k=2", "model.moe.router=sigmoid", "model.moe.dense_layers=1",
                                     "model.moe.bias_update_rate=0.001", "train.precision=fp32", "model.seq_len=32",
                                     "train.global_batch=32", "train.micro_batch=16", "zero.stage=0"])
    resolve(cfg, 1, "cpu")
    engine = build_engine(cfg, Grid.single(), torch.device("cpu"))
    layer = dict(engine.chunks[0].moe_layers())[1]
    seen = []
    hook = layer.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    with torch.no_grad():
        engine.chunks[0](torch.randint(0, 256, (16, 32), generator=torch.Generator().manual_seed(99)))
    hook.remove()
    direction = seen[0].reshape(-1, seen[0].shape[-1]).mean(0)
    with torch.no_grad():
        layer.router.weight[:2] += direction / direction.norm()  # favour experts 0 and 1 through the weights
    assert float(layer.router.expert_bias.abs().max()) == 0.0
    gen = torch.Generator().manual_seed(0)
    history = []
    for step in range(220):
        batch = torch.randint(0, 256, (32, 33), generator=gen)
        result = train_step(engine.zero, engine.executor, engine.schedule, list(batch.split(16)), 1e-4, 1.0,
                            engine.scaler)
        if step == 0:
            load = result.routers.table[0, :8]
            assert set(load.topk(2).indices.tolist()) == {0, 1}, load
        history.append(result.routers.summary()[1]["load_max_over_mean"])
    assert history[0] > 2.0, history[:3]
    first_below = next(i for i, v in enumerate(history) if v < 1.3)
    assert first_below < 150, (first_below, history[::20])
    assert max(history[150:]) < 1.3, history[150:]


@pytest.mark.parametrize("sets, fragments", [
    (["model.moe.experts=6", "parallel.ep=4", "parallel.dp=4"], ("model.moe.experts=6", "divisible by parallel.ep=4")),
    (["model.moe.experts=8", "parallel.ep=4", "parallel.dp=2"], ("parallel.ep=4", "must divide parallel.dp=2")),
    (["model.moe.experts=8", "model.moe.top_k=9"], ("model.moe.top_k=9", "<= model.moe.experts=8")),
    (["model.arch=gpt2", "model.kv_heads=null", "model.moe.experts=8"], ("model.moe.experts=8", "model.arch=llama")),
    (["parallel.ep=2"], ("parallel.ep=2", "model.moe.experts is 0")),  # expert parallelism without experts
    (["model.moe.experts=8", "model.moe.expert_hidden=15", "model.moe.shared_experts=1", "parallel.tp=2",
      "parallel.dp=1"],
     ("model.moe.expert_hidden=15", "divisible by parallel.tp=2")),  # the shared SwiGLU is split over tp
])
def test_bad_moe_settings_are_one_line(sets, fragments, capsys):
    code = pretrain_main(["--config", LLAMA, "--dry-run"] + [a for s in sets for a in ("--set", s)])
    assert_one_line(code, capsys.readouterr().err, *fragments)


def _engine_losses(sets: list[str], steps: int = 2) -> list[float]:
    from megazero.config.resolve import resolve
    from megazero.engine.build import build_engine
    from megazero.engine.step import train_step
    from megazero.parallel.topology import Grid

    cfg = load_config(LLAMA, BASE + ["train.precision=fp32", "train.global_batch=4", "train.micro_batch=2",
                                     "zero.stage=0"] + sets)
    resolve(cfg, 1, "cpu")
    engine = build_engine(cfg, Grid.single(), torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        batch = torch.randint(0, 256, (4, 17), generator=gen)
        result = train_step(engine.zero, engine.executor, engine.schedule, list(batch.split(2)), 1e-3, 1.0,
                            engine.scaler)
        losses.append(float(result.loss_total))
    return losses


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_recomputed_layers_without_auxiliary_losses_train_as_kept_ones(router):
    """Activation checkpointing recomputes a layer that counts no statistics then: with both auxiliary losses
    off, the first forward must save nothing for them either (it saved 51 tensors against the recomputation's
    47, and torch refused). The recomputed run's losses equal the kept one's (the same arithmetic, replayed)."""
    sets = [f"model.moe.router={router}", "model.moe.aux_loss=0", "model.moe.z_loss=0", "model.moe.top_k=2"]
    kept = _engine_losses(sets)
    recomputed = _engine_losses(sets + ["model.activation_checkpointing=true"])
    assert recomputed == pytest.approx(kept, rel=1e-6, abs=0), (kept, recomputed)


def test_the_shared_experts_are_dropped_out_once_and_their_down_projection_is_scaled():
    """The shared SwiGLU drops its own output; the layer's dropout is the routed part's. With the routed experts
    zeroed, each element of the output in training is 0 or 1/(1-p) times its value without dropout (twice
    dropped, it was 0 or 1/(1-p)^2). The shared down projection is a residual projection: std/sqrt(2L), as the
    routed and the dense ones."""
    from megazero.models.init import initial_value
    from megazero.models.moe import MoE
    from megazero.models.split import Split
    from megazero.parallel.tp_random import TPRandom

    cfg = load_config(LLAMA, BASE + ["model.moe.shared_experts=1", "model.dropout=0.5", "model.moe.top_k=2"]).model
    layer = MoE(cfg, Split(None, False, TPRandom()))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
        for p in (layer.experts.gate, layer.experts.up, layer.experts.down):
            p.zero_()
    x = torch.randn(4, 16, cfg.hidden, generator=torch.Generator().manual_seed(1))
    layer.eval()
    with torch.no_grad():
        whole = layer(x)
    layer.train()
    with torch.no_grad():
        dropped = layer(x)
    ratio = (dropped / whole)[whole.abs() > 1e-6]
    assert set(torch.round(ratio, decimals=4).unique().tolist()) <= {0.0, 2.0}, ratio.unique()
    assert 0.3 < float((ratio == 0).float().mean()) < 0.7  # p = 0.5 of them dropped, once

    std = {name: float(initial_value(name, (4096, 64), 7, cfg).std())
           for name in ("layers.1.mlp.shared.down.weight", "layers.1.mlp.down.weight")}
    assert std["layers.1.mlp.shared.down.weight"] == pytest.approx(std["layers.1.mlp.down.weight"], rel=0.05), std

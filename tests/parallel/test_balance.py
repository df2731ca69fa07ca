"""parallel.pp_layers=auto: the split against brute force over every split, the cost model against the one
FLOPs formula, the config's parsing and errors, and the dry run's cost shares."""
from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from megazero.config.load import load_config
from megazero.config.resolve import resolve, resolve_arch
from megazero.costs import flops_per_token, model_flops_per_token, model_shape
from megazero.errors import UserError
from megazero.parallel.balance import StageCosts, balance_layers, rank_costs
from megazero.parallel.pipeline import partition_layers

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"


# --- the split -------------------------------------------------------------------------------------


def splits(layers: int, stages: int):
    """Every way to give ``stages`` contiguous stages at least one layer each."""
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0, *cuts, layers)
        yield [b - a for a, b in zip(bounds, bounds[1:])]


def chunk_costs(counts: list[int], costs: StageCosts) -> list[float]:
    """Each virtual stage's work: its layers, plus the embedding on the first and the head on the last."""
    out = [n * costs.layer for n in counts]
    out[0] += costs.first
    out[-1] += costs.last
    return out


COSTS = [StageCosts(1.0), StageCosts(1.0, 0.0, 2.5), StageCosts(2.0, 1.0, 3.0), StageCosts(1.0, 4.0, 0.5),
         StageCosts(3.0, 0.25, 7.0), StageCosts(1.0, 0.1, 20.0)]


@pytest.mark.parametrize("pp, v", [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (2, 3), (3, 2)])
@pytest.mark.parametrize("costs", COSTS)
def test_split_is_the_exact_optimum(pp, v, costs):
    """The busiest rank's work is the least any split allows (every split of up to 11 layers tried), and inside
    each rank its model chunks are split as evenly as its layers allow."""
    stages = pp * v
    for layers in range(stages, stages + 6):
        got = balance_layers(layers, pp, costs, v)
        assert len(got) == stages and sum(got) == layers and min(got) >= 1, got
        best = min(max(rank_costs(s, pp, costs)) for s in splits(layers, stages))
        assert max(rank_costs(got, pp, costs)) == pytest.approx(best), (layers, got)
        per_chunk = chunk_costs(got, costs)
        for r in range(pp):
            mine = [vs for vs in range(stages) if vs % pp == r]
            n = sum(got[vs] for vs in mine)
            options = []
            for s in splits(n, v):
                trial = list(got)
                for vs, c in zip(mine, s):
                    trial[vs] = c
                options.append(max(chunk_costs(trial, costs)[vs] for vs in mine))
            assert max(per_chunk[vs] for vs in mine) == pytest.approx(min(options)), (layers, got, r)


def test_equal_ends_give_the_even_split():
    """No work beyond the layers: the even split, earlier stages taking the remainder (partition_layers)."""
    for layers, pp, v in ((10, 4, 1), (8, 2, 1), (7, 3, 1), (12, 2, 3), (9, 3, 2)):
        even = [len(r) for r in partition_layers(layers, pp * v)]
        assert balance_layers(layers, pp, StageCosts(3.0), v) == even
    # where several splits are as good, the earlier stages take the layers, as partition_layers does
    assert balance_layers(16, 4, StageCosts(1.0, 0.0, 3.0)) == [5, 5, 5, 1]  # not [4, 5, 5, 2]


def test_heavy_last_stage_moves_layers_to_the_first():
    assert balance_layers(8, 2, StageCosts(1.0, 0.0, 0.5)) == [4, 4]  # half a layer: moving one only swaps ends
    assert balance_layers(8, 2, StageCosts(1.0, 0.0, 2.5)) == [5, 3]  # 5 vs 5.5 beats 4 vs 6.5 and 6 vs 4.5
    assert balance_layers(40, 4, StageCosts(1.0, 0.0, 4.0)) == [11, 11, 11, 7]
    assert balance_layers(4, 2, StageCosts(1.0, 0.0, 100.0)) == [3, 1]  # each stage keeps a layer
    assert balance_layers(8, 2, StageCosts(1.0, 2.5, 0.0)) == [3, 5]  # a heavy first stage: the other way


def test_interleaved_balances_what_each_rank_does():
    """pp=2, v=2: rank 0 holds virtual stages 0 and 2, rank 1 stages 1 and 3 (the head). Rank 1's two extra
    layers' worth of head go to rank 0; inside rank 1 the head's chunk keeps one layer."""
    costs = StageCosts(1.0, 0.0, 2.0)
    got = balance_layers(8, 2, costs, 2)
    assert got == [3, 2, 2, 1]
    assert rank_costs(got, 2, costs) == [5.0, 5.0]
    assert rank_costs([2, 2, 2, 2], 2, costs) == [4.0, 6.0]


def test_rank_costs_and_bad_inputs():
    assert rank_costs([3, 5], 2, StageCosts(2.0, 1.0, 4.0)) == [7.0, 14.0]
    assert rank_costs([6], 1, StageCosts(2.0, 1.0, 4.0)) == [17.0]
    with pytest.raises(ValueError, match="fewer layers"):
        balance_layers(3, 2, StageCosts(1.0), 2)
    with pytest.raises(ValueError, match="layer cost"):
        balance_layers(4, 2, StageCosts(0.0))


def test_a_billion_layers_split_in_milliseconds():
    """The optimum is found by a search over the bottleneck, not layer by layer: model.layers may be 2^31 - 1."""
    import time

    t0 = time.perf_counter()
    got = balance_layers(10 ** 9, 2, StageCosts(1.0, 0.0, 1000.5))
    assert got == [500_000_500, 499_999_500] and time.perf_counter() - t0 < 0.5


# --- the cost model --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["gpt13b.yaml", "llama3-8b.yaml"])
def test_costs_come_from_the_flops_formula(path):
    from megazero.costs import pipeline_costs

    cfg = load_config(ROOT / "configs" / path)
    m, tp = resolve_arch(cfg.model), cfg.parallel.tp
    costs = pipeline_costs(m, tp, "bf16")
    head = flops_per_token(0, m.hidden, m.ffn_hidden, m.seq_len, m.padded_vocab, **model_shape(m)) / tp
    assert head == pytest.approx(6 * m.padded_vocab * m.hidden / tp)  # forward 2hV, backward twice that
    from megazero import costs as cost_model

    elementwise = (cost_model.LAYER_PASSES_PER_HIDDEN * m.hidden + cost_model.LAYER_PASSES_PER_MLP_INPUT
                   * (2 if m.arch == "llama" else 1) * m.ffn_hidden / tp) * 2 * cost_model.FLOPS_PER_BYTE_16BIT
    assert ((costs.layer - elementwise) * m.layers + head) * tp == pytest.approx(model_flops_per_token(m))
    assert 0.01 < elementwise / costs.layer < 0.1  # norms, residuals, the activation: a few % at this size
    assert costs.last > head  # the cross entropy, memory-bound, as FLOPs-equivalents
    assert 0 < costs.first < costs.layer / 10  # a lookup: small beside a layer, even split over tp
    fp32 = pipeline_costs(m, tp, "fp32")  # the same bytes are fewer FLOPs' worth when matmuls run 15x slower
    assert fp32.layer < costs.layer and head < fp32.last < costs.last and fp32.first < costs.first
    cpu = pipeline_costs(m, tp, "fp32", "cpu")  # a CPU core's matmuls outpace its memory less than a GPU's
    assert cpu.layer < fp32.layer and head < cpu.last < fp32.last
    wide = pipeline_costs(m, 2 * tp, "bf16")  # tp splits the matmuls and the logits, not the lookup
    norms = cost_model.LAYER_PASSES_PER_HIDDEN * m.hidden * 2 * cost_model.FLOPS_PER_BYTE_16BIT  # replicated over tp
    assert wide.layer - norms == pytest.approx((costs.layer - norms) / 2) and wide.last == pytest.approx(costs.last / 2)
    assert wide.first == costs.first


# --- the config ------------------------------------------------------------------------------------


def small(*sets: str) -> list[str]:
    """A GPT of 8 layers, hidden 256 and a 4096-word vocabulary, fp32: the head and its loss weigh 1.8 layers."""
    return ["model.layers=8", "model.hidden=256", "model.heads=4", "model.seq_len=32", "model.vocab_size=4096",
            "train.precision=fp32", "parallel.tp=1", "parallel.pp=2", "parallel.sequence_parallel=false",
            "parallel.world_size=2", *sets]


def loaded(path, sets: list[str]):
    """The config as a run's entry point has it: loaded, then resolved for its parallel.world_size."""
    cfg = load_config(path, sets)
    return resolve(cfg, cfg.parallel.world_size, "cpu")


def test_auto_resolves_to_a_plain_list(tmp_path):
    from megazero.costs import pipeline_costs

    cfg = loaded(TINY, small("parallel.pp_layers=auto"))
    costs = pipeline_costs(cfg.model, 1, cfg.train.precision)
    assert cfg.parallel.pp_layers == balance_layers(8, 2, costs) == [5, 3]
    assert all(type(n) is int for n in cfg.parallel.pp_layers)
    # what a checkpoint's meta and a resume see: the resolved list, which loads back as an explicit split
    stored = cfg.to_dict()["parallel"]["pp_layers"]
    assert stored == [5, 3]
    again = loaded(TINY, small(f"parallel.pp_layers={stored}"))
    assert again.parallel.pp_layers == cfg.parallel.pp_layers
    # from a file, and with model chunks
    path = tmp_path / "run.yaml"
    path.write_text(TINY.read_text().replace("schedule: 1f1b", "schedule: interleaved\n  virtual_stages: 2\n"
                                             "  pp_layers: auto"))
    inter = resolve(load_config(path, small("parallel.world_size=4")), 4, "cpu")
    assert len(inter.parallel.pp_layers) == 4 and sum(inter.parallel.pp_layers) == 8
    assert inter.parallel.pp_layers == balance_layers(8, 2, costs, 2)
    # no head beyond a layer's worth: the even split
    assert loaded(TINY, small("parallel.pp_layers=auto", "model.vocab_size=64")).parallel.pp_layers == [4, 4]


@pytest.mark.parametrize("value", ["autox", "[1, a]", "true", "3", "[4.0, 4.0]", "'[4, 4]'"])
def test_bad_pp_layers_are_one_line(value):
    with pytest.raises(UserError) as e:
        load_config(TINY, small(f"parallel.pp_layers={value}"))
    msg = str(e.value)
    assert "\n" not in msg and "configs/tiny.yaml (--set): parallel.pp_layers=" in msg
    assert msg.endswith("is invalid; expected a list of layer counts, one per (virtual) stage, or auto"), msg


def test_auto_with_fewer_layers_than_stages_is_the_even_splits_error():
    with pytest.raises(UserError) as even:
        load_config(TINY, small("model.layers=1"))
    with pytest.raises(UserError) as auto:
        load_config(TINY, small("model.layers=1", "parallel.pp_layers=auto"))
    assert str(auto.value) == str(even.value)
    assert "model.layers=1 is invalid; fewer layers than pipeline stages" in str(auto.value)


def test_cli_exits_2_on_a_bad_pp_layers(capsys):
    from megazero.train.run import cli

    assert cli(str(TINY), small("parallel.pp_layers=even"), dry=True) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "parallel.pp_layers='even'" in err[0]
    assert err[0].endswith("one per (virtual) stage, or auto")


# --- the dry run -----------------------------------------------------------------------------------

SHARES = re.compile(r"pp stages +layers \[([\d, ]+)\], cost share ([\d. /]+) \(busiest / least ([\d.]+)\)"
                    r"(?:; parallel\.pp_layers=auto: \[([\d, ]+)\], busiest / least ([\d.]+))?")


def dry_run_line(capsys, config: Path, *sets: str) -> re.Match:
    from megazero.train.run import dry_run

    dry_run(str(config), list(sets))
    out = capsys.readouterr().out
    found = SHARES.search(out)
    assert found, out
    return found


def test_dry_run_prints_each_stages_cost_share(capsys):
    """Every config: the split and each rank's share of the work; where auto would split otherwise, that split
    and its imbalance."""
    even = dry_run_line(capsys, TINY, *small())
    assert even.group(1) == "4, 4" and even.group(4) == "5, 3"
    shares = [float(s) for s in even.group(2).split(" / ")]
    costs = rank_costs([4, 4], 2, _costs_of(small()))
    assert shares == [round(c / sum(costs), 2) for c in costs] and shares[0] < shares[1]
    assert float(even.group(3)) == round(max(costs) / min(costs), 2) > float(even.group(5)) >= 1
    auto = dry_run_line(capsys, TINY, *small("parallel.pp_layers=auto"))
    assert auto.group(1) == "5, 3" and auto.group(4) is None  # auto's own split: nothing to suggest
    assert auto.group(3) == even.group(5)
    single = dry_run_line(capsys, TINY, *small("parallel.pp=1"))
    assert single.group(1) == "8" and single.group(2) == "1.00" and single.group(3) == "1.00"


def _costs_of(sets: list[str]) -> StageCosts:
    from megazero.costs import compute_device, pipeline_costs

    cfg = load_config(TINY, sets)
    return pipeline_costs(cfg.model, cfg.parallel.tp, cfg.train.precision, compute_device(cfg.launch.device))

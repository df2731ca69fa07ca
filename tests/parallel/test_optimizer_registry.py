"""An optimizer is a class that fulfils ``parallel.zero.update.Update`` plus one row of ``parallel.zero.registry``.

The acceptance test: plain SGD (w -= scale * lr * g), written here and registered from outside parallel/zero,
runs under ZeRO-1 and ZeRO-3 at dp 2 and lands where SGD from the same gradients does; its name is then among
the valid ones of ``optim.name``. The flat optim keys that moved into sections are refused naming their new key,
and a checkpoint that holds them still resumes under its new keys' comparisons.

Tolerance: fp32 weights after two steps of lr 0.1 on gradients of ~1e-2: one step moves a weight by ~1e-3, and
dp 2's reduction adds the two halves in another order (~1e-7 of a gradient); 1e-6 absolute is far above that
and far below one step of a wrong update (a missing 1/dp, a wrong scale or sign: ~1e-4 or more).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest
import torch
from torch import Tensor

from megazero.config.load import load_config
from megazero.config.schema import ZeroConfig
from megazero.errors import UserError
from megazero.parallel.zero.layout import Bucket, BucketLayout
from megazero.parallel.zero.registry import OPTIMIZERS, Row
from megazero.parallel.zero.update import Record, UpdateContext
from tests.dist import run_ranks
from tests.runs import ROOT

TINY = str(ROOT / "configs" / "tiny.yaml")
LR, STEPS, ATOL = 0.1, 2, 1e-6


@dataclass
class ToySgdSection:
    """``optim.toy_sgd``: plain SGD."""

    scale: float = 1.0  # multiplies the step's learning rate


class ToySgd:
    """w -= scale * lr * g on this rank's share; no moments (fp32 parameters are their own masters)."""

    def __init__(self, layout: BucketLayout, scale: float):
        n = len(layout.buckets)
        self.layout, self.scale, self.step_count = layout, scale, 0
        self.master: list[Optional[Tensor]] = [None] * n
        self.master_is_param = [True] * n
        self.exp_avg: list[Optional[Tensor]] = [None] * n
        self.exp_avg_sq: list[Optional[Tensor]] = [None] * n
        self.counted: list[list] = [[] for _ in range(n)]

    def add_bucket(self, b: Bucket, initial: Tensor, decay: list, count: list) -> None:
        lo, hi = self.layout.range(b)
        target = b.shard_param if b.shard_param is not None else b.full[lo:hi]
        assert target.dtype == torch.float32, "the toy steps fp32 parameters in place"
        self.master[b.index], self.counted[b.index] = target, count

    def grad_ready(self, b: Bucket, grad: Tensor) -> None:
        pass

    def discard(self) -> None:
        pass

    def reads_reduced_gradients(self) -> bool:
        return True

    def may_read_local_gradients(self) -> bool:
        return False

    def wrote_whole_params(self) -> bool:
        return False

    def states_loaded(self) -> None:
        pass

    def sq_norm(self, grads: list[Tensor]) -> Tensor:
        total = torch.zeros((), dtype=torch.float64)
        for b, g in zip(self.layout.buckets, grads):
            for a, z, counts in self.counted[b.index]:
                if counts:
                    total += g[a:z].double().square().sum()
        return total.float()

    def first_nonfinite(self, grads: list[Tensor]) -> Optional[str]:
        return None

    def update(self, grads: list[Tensor], lr: float, grad_scale: float, resend: set[int]) -> None:
        self.step_count += 1
        for b, g in zip(self.layout.buckets, grads):
            self.master[b.index].add_(g, alpha=-self.scale * lr * grad_scale)

    def offloaded(self) -> bool:
        return False

    def state_bytes(self) -> int:
        return 0

    def staging_bytes(self) -> int:
        return 0

    def state_tensors(self) -> list[Tensor]:
        return []

    def staging_tensors(self) -> list[Tensor]:
        return []

    def bucket_states(self, i: int) -> dict[str, Optional[Tensor]]:
        return {"master": self.master[i], "exp_avg": None, "exp_avg_sq": None}

    def load_bucket_states(self, i: int, states: dict[str, Tensor]) -> None:
        pass  # the parameters are their own masters, and there are no moments

    def disk_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass

    def rank_state(self, step: int) -> dict[str, Tensor]:
        return {}

    def record(self) -> Optional[Record]:
        return None


def make_toy_sgd(section: ToySgdSection, ctx: UpdateContext) -> ToySgd:
    return ToySgd(ctx.layout, section.scale)


ROW = Row("toy_sgd", ToySgdSection, make_toy_sgd)
# the optim section as make_zero reads it (the schema's OptimConfig was made before this row was added)
TOY = SimpleNamespace(name="toy_sgd", toy_sgd=ToySgdSection())


def _batches() -> list[list[Tensor]]:
    """Per step, two microbatches of two random sequences: the global batch (dp 2: one microbatch per rank)."""
    gen = torch.Generator().manual_seed(0)
    return [[torch.randint(0, 512, (2, 33), generator=gen) for _ in range(2)] for _ in range(STEPS)]


def _train(rank: int, world: int, stage: int) -> dict:
    """``STEPS`` steps of the toy at ZeRO ``stage`` over ``world`` dp ranks; the whole parameters after them."""
    from megazero.engine.build import make_executor, make_schedules, make_zero
    from megazero.engine.step import train_step
    from megazero.models.build import build_gpt
    from megazero.parallel.topology import Grid
    from megazero.parallel.dims import ParallelDims

    OPTIMIZERS["toy_sgd"] = ROW  # a spawned rank imports the registry afresh: the row is registered here too
    cfg = load_config(TINY, ["parallel.tp=1", "parallel.pp=1", "model.layers=2", "model.seq_len=32"]).model
    grid = Grid.build(ParallelDims(tp=1, pp=1, dp=world), "cpu")
    model = build_gpt(cfg, 0, tp=grid.tp_comm)
    zero = make_zero([model], grid, ZeroConfig(stage=stage, bucket_mb=0.01, reshard_after_forward=True), "fp32",
                     0.0, torch.device("cpu"), optim=TOY)  # the builder's path: the row's factory and section
    mine = 2 // world
    executor = make_executor([model], grid, torch.device("cpu"), 2, 32, cfg.hidden, "fp32", 2 * 2 * 32)
    schedule = make_schedules("1f1b", grid, mine)[0]
    for mbs in _batches():
        result = train_step(zero, executor, schedule, mbs[rank * mine:(rank + 1) * mine], LR, 0.0)
        assert not result.skipped
    return {n: t.numpy() for n, t in zero.full_parameters().items()}  # numpy: no shared-memory handles


def _reference() -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """One process without ZeRO's sharding: plain autograd gradients of the global batch's mean loss, stepped by
    hand; returns (the start, SGD's weights, the toy's at dp 1 and stage 0) to compare."""
    from tests.runs import steps_recording_gradients
    from megazero.engine.build import make_zero
    from megazero.models.build import build_gpt
    from megazero.parallel.topology import Grid

    cfg = load_config(TINY, ["parallel.tp=1", "parallel.pp=1", "model.layers=2", "model.seq_len=32"]).model
    grid = Grid.single()
    model = build_gpt(cfg, 0, tp=grid.tp_comm)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    zero, grads = steps_recording_gradients(
        model, grid, lambda: make_zero([model], grid, ZeroConfig(stage=0, bucket_mb=0.01, reshard_after_forward=True),
                                       "fp32", 0.0, torch.device("cpu"), optim=TOY), 512, 32, STEPS, LR)
    want = {n: w - LR * sum(g[n] for g in grads) for n, w in start.items()}
    return start, want, zero.full_parameters()


def test_a_toy_registered_from_outside_runs_at_dp2_zero1_and_zero3(monkeypatch):
    monkeypatch.setitem(OPTIMIZERS, "toy_sgd", ROW)
    start, want, dp1 = _reference()
    for n, w in want.items():  # the toy is SGD: its one-process weights are the hand-stepped ones
        assert torch.allclose(dp1[n], w, rtol=0, atol=ATOL), (n, (dp1[n] - w).abs().max())
    moved = max((want[n] - start[n]).abs().max().item() for n in want)
    assert moved > 100 * ATOL, moved  # the steps move weights far past the tolerance
    for stage in (1, 3):
        got = run_ranks(2, _train, stage)
        for rank_params in got:
            for n, w in want.items():
                got_n = torch.from_numpy(rank_params[n])
                assert torch.allclose(got_n, w, rtol=0, atol=ATOL), (stage, n, (got_n - w).abs().max())


def test_a_registered_row_is_among_the_valid_names(monkeypatch):
    with pytest.raises(UserError) as before:
        load_config(TINY, ["optim.name=nope"])
    assert "toy_sgd" not in str(before.value)
    monkeypatch.setitem(OPTIMIZERS, "toy_sgd", ROW)
    with pytest.raises(UserError) as after:
        load_config(TINY, ["optim.name=nope"])
    line = str(after.value)
    assert "\n" not in line and "optim.name='nope'" in line and "valid: adamw | lamb | muon | onebit_adam | onebit_lamb | zero_one_adam | toy_sgd" \
        in line, line


@pytest.mark.parametrize("key, value, new", [
    ("freeze_step", 3, "optim.onebit_adam.freeze_step"), ("ns_steps", 3, "optim.muon.ns_steps"),
    ("adamw_lr", 0.1, "optim.muon.adamw_lr"), ("momentum", 0.9, "optim.muon.momentum"),
    ("beta1", 0.8, "optim.adamw.beta1"), ("eps", 1e-6, "optim.onebit_adam.eps")])
def test_flat_keys_are_refused_naming_their_new_key(tmp_path, key, value, new):
    with pytest.raises(UserError) as by_set:
        load_config(TINY, [f"optim.{key}={value}"])
    path = tmp_path / "old.yaml"
    path.write_text(Path(TINY).read_text() + f"\noptim:\n  {key}: {value}\n")
    with pytest.raises(UserError) as in_file:
        load_config(str(path))
    for line in (str(by_set.value), str(in_file.value)):
        assert "\n" not in line and f"optim.{key} moved to " in line and new in line, line


def test_the_cli_refuses_a_flat_key_with_exit_2(capsys):
    from tests.hostile import assert_one_line, call, pretrain_main

    code, _, err = call(pretrain_main, ["--config", TINY, "--dry-run", "--set", "optim.freeze_step=3"], capsys)
    assert_one_line(code, err, "optim.freeze_step moved to optim.<name>.freeze_step", "optim.onebit_adam.freeze_step",
                    "optim.onebit_lamb.freeze_step")  # two sections hold it: the one of optim.name


def test_a_checkpoint_with_flat_keys_is_compared_under_the_new_ones():
    """meta.json written before the sections: its optim.freeze_step/beta2 are read as optim.onebit_adam's."""
    from megazero.train.onebit_resume import check_onebit_layout

    sets = ["optim.name=onebit_adam", "optim.onebit_adam.freeze_step=3", "train.steps=10", "parallel.tp=1",
            "parallel.pp=1", "parallel.dp=2", "zero.stage=1"]
    here = load_config(TINY, sets)
    stored = here.to_dict()
    stored["optim"] = {"name": "onebit_adam", "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "momentum": 0.95,
                       "nesterov": True, "ns_steps": 5, "adamw_lr": 0.0, "freeze_step": 3}
    check_onebit_layout(Path("ckpt"), {"optimizer_step": 6, "config": stored}, here)  # the same: resumes
    for changed, named in (("optim.onebit_adam.freeze_step=4", "optim.onebit_adam.freeze_step is 3 there and 4"),
                           ("optim.onebit_adam.beta2=0.99", "optim.onebit_adam.beta2 is 0.95 there and 0.99")):
        with pytest.raises(UserError) as e:
            check_onebit_layout(Path("ckpt"), {"optimizer_step": 6, "config": stored}, load_config(TINY, sets + [changed]))
        assert "\n" not in str(e.value) and named in str(e.value), str(e.value)


def test_a_registered_row_is_in_the_configuration_reference(monkeypatch):
    """docs/config.md is written from the registry: the row's section, its key and its name as a valid value."""
    from megazero.config.reference import page

    assert "optim.toy_sgd" not in page()
    monkeypatch.setitem(OPTIMIZERS, "toy_sgd", ROW)
    text = page()
    assert "## `optim.toy_sgd`" in text and "| `optim.toy_sgd.scale` |" in text, text[-1500:]
    assert "`zero_one_adam` \\| `toy_sgd`" in text


def test_the_rules_read_what_a_row_declares_not_its_name(monkeypatch):
    """Where the states may live, which ZeRO stages run and which keys name a step come from the row: changing a
    row's declarations changes the verdicts, and each refusal names the row's reason."""
    from dataclasses import replace

    onebit = ["optim.name=onebit_adam", "optim.onebit_adam.freeze_step=5", "train.steps=10"]
    load_config(TINY, ["optim.name=lamb", "zero.offload_optimizer=cpu"])  # LAMB's row lets it move to the host
    monkeypatch.setitem(OPTIMIZERS, "lamb", replace(OPTIMIZERS["lamb"], device_only="a toy reason to stay"))
    with pytest.raises(UserError) as e:
        load_config(TINY, ["optim.name=lamb", "zero.offload_optimizer=cpu"])
    assert "zero.offload_optimizer" in str(e.value) and "a toy reason to stay" in str(e.value), str(e.value)
    for sets, key in ((["zero.stage=2"], "zero.stage"), (["optim.onebit_adam.freeze_step=10"], "freeze_step"),
                      (["zero.offload_optimizer=cpu"], "zero.offload_optimizer")):
        with pytest.raises(UserError) as e:
            load_config(TINY, onebit + sets)
        assert key in str(e.value) and "\n" not in str(e.value), str(e.value)
    monkeypatch.setitem(OPTIMIZERS, "onebit_adam", replace(OPTIMIZERS["onebit_adam"], device_only="", whole_grads="",
                                                           before_last_step=()))
    for sets in (["zero.stage=2"], ["optim.onebit_adam.freeze_step=10"], ["zero.offload_optimizer=cpu"]):
        load_config(TINY, onebit + sets)  # the row no longer declares them: the rules no longer refuse


def test_a_resume_and_the_planner_ask_the_row(monkeypatch):
    """The resume check and the planner's extra step work are the row's: a row that declares them is called,
    whatever its name (here AdamW's row, which declares neither)."""
    from dataclasses import replace

    import megazero.train.resume_changes as resume_changes
    from megazero.config.resolve import resolve
    from megazero.plan.optimizer_step import OptimizerStep
    from megazero.plan.stage_plan import make_plan
    from megazero.plan.table import format_plan

    cfg = load_config(TINY, ["parallel.tp=1", "parallel.pp=1"])
    meta = {"config": {"optim": {"name": "adamw"}}}
    monkeypatch.setattr(resume_changes, "read_meta", lambda path: meta)
    resume_changes.check_resume(Path("ckpt"), cfg)  # AdamW's row: no check
    assert make_plan(resolve(cfg, 1, "cpu")).stages[0].optimizer_step == OptimizerStep.none()
    seen = []

    def refuse(path, their_meta, here):
        seen.append((path, their_meta, here))
        raise UserError(f"checkpoint {path}: a toy refusal")

    toy = OptimizerStep(sent=3 * 2 ** 30, calls=4, flops=2e12, transient=2 ** 30, what="toy exchanges", source="toy")
    monkeypatch.setitem(OPTIMIZERS, "adamw", replace(OPTIMIZERS["adamw"], resume_check=refuse,
                                                     plan_step=lambda c, layers: toy))
    with pytest.raises(UserError, match="a toy refusal"):
        resume_changes.check_resume(Path("ckpt"), cfg)
    assert seen == [(Path("ckpt"), meta, cfg)]
    plan = make_plan(resolve(cfg, 1, "cpu"))
    assert plan.stages[0].optimizer_step == toy
    table = format_plan(plan)
    assert "adamw: per rank and step, 3.22 GB in 4 all-to-alls" in table and "toy exchanges" in table, table[-1500:]


def test_nothing_outside_the_registry_compares_the_optimizer_name_to_a_literal():
    """What an optimizer needs is declared on its row; a comparison of ``optim.name`` with a name elsewhere is
    the string switch the registry replaces (it missed a new optimizer the row would have named)."""
    import re

    names = "|".join(OPTIMIZERS)
    compare = re.compile(  # optim.name against any literal; any name (o.name, name, a match) against a row's name
        rf"optim\.name\s*(==|!=|in)\s*[(\[{{]?\s*['\"]|['\"]\s*(==|!=)\s*\w*\.?optim\.name|"
        rf"(==|!=)\s*['\"]({names})['\"]|['\"]({names})['\"]\s*(==|!=)|\bin\s*[(\[{{][^)\]}}]*['\"]({names})['\"]|"
        rf"case\s*['\"]({names})['\"]")
    found = []
    for folder in ("megazero", "models", "parallel", "kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if compare.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_fit_check_offers_offloading_only_where_the_row_allows_it():
    """Out of memory with no knob that fits: offloading the optimizer is named as a way out for AdamW, not for an
    optimizer whose row keeps its states on the device (the rules would refuse it)."""
    import torch

    from megazero.config.resolve import resolve
    from megazero.plan.fits import check_fits

    for name, offered in (("adamw", True), ("muon", False), ("onebit_adam", False)):
        cfg = resolve(load_config(TINY, ["parallel.tp=1", "parallel.pp=1", "parallel.sequence_parallel=false",
                                         f"optim.name={name}", "train.steps=10",
                                         "optim.onebit_adam.freeze_step=5"]), 1, "cpu")
        with pytest.raises(UserError) as e:
            check_fits(cfg, torch.device("cpu"), 0, 0, 1, available=1000)
        line = str(e.value)
        assert "no single knob fits" in line and ("zero.offload_optimizer=cpu" in line) == offered, (name, line)

"""train.precision: auto resolves to bf16 where the device computes it natively and to fp32 elsewhere, and the
run's first line says which and why. The CPU's answer is its AMX tiles (torch.cpu._is_amx_tile_supported):
without them torch converts bf16 operands to fp32 and back, slower than fp32 (docs: the resolve docstring)."""
from __future__ import annotations

import contextlib
import io

import pytest
import torch

from megazero.config.load import load_config
from megazero.config.resolve import precision_for, resolve
from megazero.train.run import run
from tests.runs import ROOT, small_overrides, write_corpus

TINY = str(ROOT / "configs" / "tiny.yaml")
ONE = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "parallel.sequence_parallel=false"]


@pytest.mark.parametrize("amx, want", [(True, "bf16"), (False, "fp32")])
def test_auto_on_a_cpu_follows_its_amx_tiles(monkeypatch, amx, want):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    cfg = load_config(TINY, ONE)
    assert cfg.train.precision == "auto"  # tiny.yaml asks for it
    assert resolve(cfg, 1, "cpu").train.precision == want
    assert ("AMX" in precision_for("cpu")[1]) and (want == "bf16") == ("no AMX" not in precision_for("cpu")[1])


def test_auto_plans_a_gpu_run_in_bf16_and_an_explicit_precision_stays():
    assert resolve(load_config(TINY, ONE), 1, "cuda", planned=True).train.precision == "bf16"
    assert resolve(load_config(TINY, ONE + ["train.precision=bf16"]), 1, "cpu").train.precision == "bf16"


def test_the_first_line_of_a_run_says_which_and_why(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    sets = small_overrides(write_corpus(tmp_path / "text"), tmp_path / "cache", tmp_path / "run", steps=1)
    sets = [s for s in sets if not s.startswith("train.precision=")] + ["train.precision=auto"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        records = run(TINY, sets)
    first = out.getvalue().splitlines()[0]
    assert first.startswith("train.precision=auto: fp32 (this CPU has no AMX tiles"), first
    assert records and records[-1]["step"] == 1

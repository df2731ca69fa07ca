"""An export of a mixture of experts trained with an expert capacity (``model.moe.capacity_factor`` > 0) says
in one warning line on stderr that transformers routes every token, and still exports (exit 0); a dropless run
(0), or a capacity that holds every token (factor * top_k >= experts: 2.0 here), exports silently.
Through ``python -m megazero.export``'s main in this process, on one tiny Mixtral-shaped checkpoint (untrained
weights: only the stored config's model.moe section decides) whose meta.json's capacity_factor each case sets.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megazero.interop.export import main as export_main
from tests.hostile import call
from tests.interop.test_hostile_export import MODEL, STEP, write_run

MOE = ["model.arch=llama", "model.kv_heads=1", "model.moe.experts=4", "model.moe.top_k=2", "model.ffn_hidden=32"]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """base/run/checkpoints/step_00000001: a dropless Mixtral-shaped llama MoE, with its tokenizer recorded."""
    base = tmp_path_factory.mktemp("export_capacity")
    write_run(base, MODEL + MOE)
    return base


@pytest.mark.parametrize("capacity", [0.0, 1.25, 2.0])
def test_an_export_with_an_expert_capacity_warns_in_one_line_and_succeeds(made, capsys, tmp_path, capacity):
    shutil.copytree(made / "run", tmp_path / "run")
    ck = tmp_path / "run" / "checkpoints" / STEP
    meta = json.loads((ck / "meta.json").read_text())
    meta["config"]["model"]["moe"]["capacity_factor"] = capacity  # a training setting: any run may have it
    (ck / "meta.json").write_text(json.dumps(meta))
    code, out, err = call(export_main, [str(ck), str(tmp_path / "hf")], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    lines = [line for line in err.splitlines() if line.strip()]
    if capacity in (0.0, 2.0):  # E=4, top_k=2: at 2.0 each expert may take every token
        assert lines == [], err
        return
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("warning:"), line
    for fragment in ("model.moe.capacity_factor=1.25", "routes every token", "differ"):
        assert fragment in line, (fragment, line)

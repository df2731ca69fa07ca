"""The config resolved once: load_config checks and writes nothing, megazero.config.resolve.resolve fixes every
derived value, a second resolve changes nothing, and nothing downstream of a run's entry point resolves
again (read from the source, and counted while a dry run and a simulation run in this process)."""
from __future__ import annotations

import ast
import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megazero.config.load import load_config
from megazero.config.resolve import resolve
from megazero.config.rules import validate

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
GPT13B = ROOT / "configs" / "gpt13b.yaml"
# every value auto or unset stands for: arch keys, dp, reshard_after_forward, kernels, log.dir, pp_layers
OPEN = ["parallel.dp=auto", "parallel.pp_layers=auto", "zero.reshard_after_forward=auto", "kernels.attention=auto",
        "kernels.adam=auto", "log.dir=", "model.bias=auto", "model.tie_embeddings=auto"]
RESOLVERS = {"resolve", "resolve_world", "resolve_kernels", "resolve_arch", "resolve_impl", "world_dp"}


def _state(cfg) -> tuple:
    return cfg.to_dict(), cfg.name, cfg.source


def _count_balancing(monkeypatch) -> list:
    import megazero.config.resolve as module

    calls: list = []
    real = module.balance_layers
    monkeypatch.setattr(module, "balance_layers", lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


@pytest.mark.parametrize("device, planned", [("cpu", False), ("cuda", True)])
def test_a_second_resolve_changes_nothing_and_balances_nothing(monkeypatch, device, planned):
    balanced = _count_balancing(monkeypatch)
    cfg = load_config(GPT13B, OPEN)
    first = resolve(cfg, 64, device, planned=planned)
    assert first is cfg and len(balanced) == 1  # the balancing ran, once
    p, m = cfg.parallel, cfg.model
    assert (p.dp, cfg.zero.reshard_after_forward, cfg.log.dir) == (8, False, str(Path("runs") / "gpt13b"))
    assert isinstance(p.pp_layers, list) and sum(p.pp_layers) == m.layers and cfg.microbatches == 128
    assert (m.bias, m.tie_embeddings, m.ffn_hidden) == (True, True, 4 * m.hidden)
    assert "auto" not in (cfg.kernels.attention, cfg.kernels.adam)
    before = copy.deepcopy(_state(cfg))
    assert resolve(cfg, 64, device, planned=planned) is cfg
    assert _state(cfg) == before and len(balanced) == 1  # every field equal; no second balancing


def test_load_config_and_validate_write_nothing(monkeypatch):
    """load_config returns the values as written (auto stays auto); validate only checks."""
    balanced = _count_balancing(monkeypatch)
    for path, sets in ((TINY, OPEN), (GPT13B, OPEN), (ROOT / "configs" / "llama3-8b.yaml", OPEN[:2])):
        cfg = load_config(path, sets)
        assert (cfg.parallel.pp_layers, cfg.parallel.dp, cfg.kernels.adam) == ("auto", "auto", "auto")
        assert cfg.log.dir == "" and cfg.model.bias == "auto" and cfg.zero.reshard_after_forward == "auto"
        before = copy.deepcopy(_state(cfg))
        validate(cfg)
        assert _state(cfg) == before
    assert not balanced


def _calls_and_imports(path: Path) -> list[str]:
    """Every resolver a file calls (f(...), module.f(...); ``x.resolve()`` is pathlib's) or imports: by name, or
    the module megazero.config.resolve itself."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in RESOLVERS and not (isinstance(f, ast.Attribute) and name == "resolve"):
                found.append(f"{where} calls {name}")
        elif isinstance(node, ast.ImportFrom):
            found += [f"{where} imports {a.name}" for a in node.names if a.name in RESOLVERS
                      or f"{node.module}.{a.name}" == "megazero.config.resolve"]
            if node.module == "megazero.config.resolve":
                found.append(f"{where} imports megazero.config.resolve")
        elif isinstance(node, ast.Import):
            found += [f"{where} imports {a.name}" for a in node.names if a.name == "megazero.config.resolve"]
    return found


DOWNSTREAM = [ROOT / "megazero" / "plan" / f for f in ("stage_plan.py", "params.py", "state_bytes.py",
                                                       "activations.py", "simulate.py", "step_time.py", "fits.py",
                                                       "table.py", "tracker.py", "context.py", "links.py")] \
    + sorted(p for p in (ROOT / "megazero" / "train").glob("*.py") if p.name != "run.py") \
    + sorted((ROOT / "megazero" / "engine").glob("*.py"))


def test_nothing_downstream_of_the_entry_point_resolves():
    """The plan, the step-time model, fits, --simulate, the trainer and the engine read the resolved config;
    only the entry points resolve: the run's (megazero.train.run: run, dry run, simulate) and the planner's
    (megazero.plan.cli, and the layout search and the published rows, each candidate or row a run of its own,
    resolved once), and a checkpoint's model section is read through resolve_arch."""
    found = [hit for path in DOWNSTREAM for hit in _calls_and_imports(path)]
    assert not found, found
    assert _calls_and_imports(ROOT / "megazero" / "train" / "run.py")  # the check sees what it looks for


def _count_resolves(monkeypatch) -> dict:
    """Wrap resolve and kernels.resolve_kernels wherever a module holds them, counting calls."""
    import megazero.kernels.choice as kernels
    import megazero.config.resolve as module

    counts = {"resolve": 0, "resolve_kernels": 0}
    for name, real in (("resolve", module.resolve), ("resolve_kernels", kernels.resolve_kernels)):
        def counted(*a, _real=real, _name=name, **k):
            counts[_name] += 1
            return _real(*a, **k)

        for mod in list(sys.modules.values()):
            if getattr(mod, name, None) is real:
                monkeypatch.setattr(mod, name, counted)
    return counts


def test_a_dry_run_resolves_once(monkeypatch, capsys):
    import megazero.plan.stage_plan  # noqa: F401 (imported before counting: any binding it holds is wrapped)
    import megazero.train.run as run

    counts = _count_resolves(monkeypatch)
    plan = run.dry_run(str(GPT13B), OPEN + ["parallel.world_size=64"])
    assert counts == {"resolve": 1, "resolve_kernels": 1}, counts
    assert plan.cfg.parallel.dp == 8 and "dry run" in capsys.readouterr().out


def test_a_simulation_resolves_once(monkeypatch, capsys, tmp_path):
    import megazero.plan.simulate  # noqa: F401
    import megazero.train.trainer  # noqa: F401
    import megazero.train.run as run

    counts = _count_resolves(monkeypatch)
    sets = ["parallel.tp=1", "parallel.pp=1", "parallel.world_size=1", "model.layers=1", "model.hidden=32",
            "model.heads=2", "model.seq_len=16", "model.vocab_size=128", "train.global_batch=2",
            "train.micro_batch=2", "launch.memory_gb=80", f"log.dir={tmp_path}"]
    assert run.cli(str(TINY), sets, dry=False, simulate=True) == 0, capsys.readouterr().err
    assert counts == {"resolve": 1, "resolve_kernels": 1}, counts
    assert (tmp_path / "simulate.json").is_file()


def test_a_planned_run_needs_no_cuda_or_triton_here(monkeypatch, capsys):
    """--dry-run on a machine without a GPU plans the GPU run: auto kernels take the planned device's choice,
    an explicit triton is kept for the machine that runs it (which checks it when the run starts)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cfg = resolve(load_config(GPT13B, ["kernels.attention=triton"]), 64, "cuda", planned=True)
    assert cfg.kernels.attention == "triton" and cfg.kernels.adam in ("triton", "torch")
    from megazero.train.run import dry_run

    dry_run(str(GPT13B), ["kernels.attention=triton", "kernels.adam=triton", "parallel.world_size=64"])
    assert capsys.readouterr().out.strip().endswith("no process group was started")


def test_costs_and_config_loading_import_no_torch():
    """The FLOPs formulas and the stage costs are arithmetic: loading and checking a config stays torch-free."""
    code = ("import sys; import megazero.costs, megazero.config.load as L; L.load_config(sys.argv[1]); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(GPT13B)], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr


STAGE_NUMBER = re.compile(r"stage *(==|!=|>=|<=|<|>) *[0-9]|stage in \(|[0-9] *(==|!=|>=|<=|<|>) *[A-Za-z_.]*stage\b")


def test_no_stage_number_comparison_outside_stage_policy():
    """What a ZeRO stage does is parallel.zero.StagePolicy's named fields; everything outside it (the plan, the
    config, the engine, the trainer, ZeRO's own parts, the benchmarks) reads those, never the number."""
    tops = ("megazero", "models", "parallel", "kernels", "bench")
    files = [p for top in tops for p in sorted((ROOT / top).rglob("*.py"))
             if p != ROOT / "parallel" / "zero" / "policy.py"] + [ROOT / "pretrain.py"]
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in files
             for i, line in enumerate(p.read_text().splitlines(), 1) if STAGE_NUMBER.search(line)]
    assert not found, found

"""Config parsing and validation, and the CLI's one-line errors with exit code 2."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megazero.config.load import load_config, parse_set
from megazero.config.resolve import resolve
from megazero.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path, text, name="run.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_tiny_config_loads_with_typed_sections():
    cfg = resolve(load_config(ROOT / "configs" / "tiny.yaml"), 4, "cpu")
    assert cfg.name == "tiny" and cfg.log.dir == str(Path("runs") / "tiny")
    assert isinstance(cfg.model.layers, int) and isinstance(cfg.train.lr, float)
    assert cfg.model.ffn_hidden == 4 * cfg.model.hidden  # default


@pytest.mark.parametrize("name", ["gpt-125m", "gpt-1.3b", "gpt13b"])
def test_shipped_configs_are_valid(name):
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    assert cfg.model.hidden % cfg.model.heads == 0


def test_gpt13b_is_gpt3_13b_on_64_gpus():
    cfg = load_config(ROOT / "configs" / "gpt13b.yaml")
    m = cfg.model
    assert (m.layers, m.hidden, m.heads, m.seq_len) == (40, 5120, 40, 2048)
    resolve(cfg, 64, "cuda", planned=True)
    assert cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp == 64


def test_overrides_are_typed_and_applied(tmp_path):
    cfg = load_config(write(tmp_path, "train:\n  steps: 5\n  warmup_steps: 1\n"),
                      ["train.steps=7", "train.lr=1e-3", "model.bias=false"])
    assert cfg.train.steps == 7 and cfg.train.lr == 1e-3 and cfg.model.bias is False
    assert parse_set("parallel.dp=auto") == ("parallel", "dp", "auto")
    assert parse_set("parallel.tp=2") == ("parallel", "tp", 2)


def test_dp_auto_resolves_from_world_size():
    cfg = load_config(None, ["parallel.tp=2", "train.global_batch=8", "train.micro_batch=2"])
    resolve(cfg, 4, "cpu")
    assert cfg.parallel.dp == 2 and cfg.microbatches == 2


def test_padded_vocab_is_the_same_at_every_tp():
    """Padding does not depend on tp, so checkpoints move between tp sizes; every tp in 1..128 divides it."""
    for tp in (1, 2, 4, 8):
        v = load_config(None, ["model.vocab_size=50257", f"parallel.tp={tp}", "model.heads=8"]).model.padded_vocab
        assert v == 50304 and v % (128) == 0 and v % tp == 0


# (override, fragments the one-line message must contain)
BAD = [
    (["train.stepz=3"], ["train.stepz", "did you mean 'steps'"]),
    (["modle.layers=3"], ["modle", "did you mean 'model'"]),
    (["train.steps=ten"], ["train.steps", "'ten'", "integer"]),
    (["model.bias=1"], ["model.bias", "true or false"]),
    (["train.steps=0"], ["train.steps", ">= 1"]),
    (["model.dropout=1.5"], ["model.dropout", "[0, 1)"]),
    (["train.precision=fp8"], ["train.precision", "'fp8'", "fp32 | bf16 | fp16"]),
    (["model.hidden=100", "model.heads=3"], ["model.heads=3", "model.hidden=100"]),
    (["train.global_batch=10", "train.micro_batch=4"], ["train.global_batch=10", "micro_batch=4"]),
    (["data.paths=[/no/such/corpus.txt]"], ["data.paths", "/no/such/corpus.txt"]),
    (["data.tokenizer=/no/such.model"], ["data.tokenizer", "/no/such.model"]),
    (["data.split=abc"], ["data.split", "'abc'"]),
    (["data.split=0,1"], ["data.split='0,1'", "train > 0"]),
    (["data.split=100,0", "train.eval_every=5"], ["data.split='100,0'", "no validation data", "train.eval_every=5"]),
    (["train.resume=/no/ckpt"], ["train.resume", "/no/ckpt"]),
    (["launch.device=tpu"], ["launch.device", "'tpu'"]),
    (["parallel.tp=4"], ["model.heads=6", "parallel.tp=4"]),
    (["parallel.tp=2", "model.ffn_hidden=501"], ["model.ffn_hidden=501", "parallel.tp=2"]),
    (["parallel.tp=3", "model.heads=3", "model.ffn_hidden=768"], ["vocab_pad_multiple", "2048", "parallel.tp=3"]),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "model.seq_len=127"],
     ["model.seq_len=127", "sequence_parallel"]),
    (["parallel.pp=8"], ["model.layers=4", "fewer layers than pipeline stages"]),
    (["parallel.pp=2", "parallel.pp_layers=[1,2]"], ["parallel.pp_layers=[1, 2]", "summing to model.layers=4"]),
    (["parallel.pp=2", "parallel.schedule=interleaved"], ["parallel.schedule='interleaved'", "virtual_stages >= 2"]),
    (["parallel.pp=2", "parallel.virtual_stages=2"], ["parallel.virtual_stages=2", "schedule=interleaved"]),
    (["parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2", "parallel.dp=1",
      "train.global_batch=24", "train.micro_batch=8"],
     ["train.global_batch=24", "3 microbatches", "multiple of parallel.pp (2)"]),
    (["parallel.schedule=zigzag"], ["parallel.schedule='zigzag'", "gpipe | 1f1b | interleaved | zb1p"]),
    (["parallel.pp=2", "parallel.schedule=zb1p", "zero.stage=3", "zero.reshard_after_forward=true"],
     ["zero.reshard_after_forward=True", "parallel.schedule=zb1p"]),
    (["zero.stage=4"], ["zero.stage=4", "0 | 1 | 2 | 3"]),
    (["zero.offload_params=cpu"], ["zero.offload_params='cpu'", "zero.stage=3"]),
    (["zero.offload_optimizer=disk"], ["zero.offload_optimizer='disk'", "none | cpu | nvme"]),
    (["zero.grad_dtype=fp8"], ["zero.grad_dtype='fp8'", "auto | fp32 | model"]),
    (["train.lr=.nan"], ["train.lr", "finite number"]),  # NaN compares false to every bound
    (["model.init_std=.inf"], ["model.init_std", "finite number"]),
    (["log.peak_tflops=-5"], ["log.peak_tflops", ">= 1e-09"]),
]


@pytest.mark.parametrize("overrides,fragments", BAD)
def test_bad_values_raise_one_line(overrides, fragments):
    with pytest.raises(UserError) as e:
        load_config(ROOT / "configs" / "tiny.yaml", overrides)
    msg = str(e.value)
    assert "\n" not in msg and "configs/tiny.yaml" in msg
    for frag in fragments:
        assert frag in msg, (frag, msg)


def test_world_size_mismatch_and_batch_per_dp():
    cfg = load_config(None, ["parallel.tp=2", "parallel.dp=2", "train.micro_batch=1"])
    with pytest.raises(UserError, match=r"tp\*pp\*dp = 2\*1\*2 = 4 does not match the world size 6"):
        resolve(cfg, 6, "cpu")
    cfg = load_config(None, ["train.global_batch=9", "train.micro_batch=3"])
    with pytest.raises(UserError, match=r"micro_batch\*parallel.dp = 3\*2 = 6"):
        resolve(cfg, 2, "cpu")


def cli(args, env_extra=None, cwd=ROOT):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, str(ROOT / "pretrain.py"), *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=120)


def assert_one_line_error(proc, *fragments):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])


def test_cli_errors_are_one_line_exit_2(tmp_path):
    assert_one_line_error(cli(["--config", "configs/nope.yaml"]), "configs/nope.yaml")
    assert_one_line_error(cli(["--config", "configs/tiny.yaml", "--set", "train.stepz=3"]), "did you mean 'steps'")
    assert_one_line_error(cli(["--config", "configs/tiny.yaml", "--set", "model.heads=5"]), "model.heads=5")
    assert_one_line_error(cli(["--config", "configs/tiny.yaml", "--set", "train.global_batch=21"]),
                          "train.global_batch=21")
    assert_one_line_error(cli(["--config", "configs/tiny.yaml", "--set", "oops"]), "section.key=value")
    bad_yaml = write(tmp_path, "model:\n  layers: [1,\n")
    assert_one_line_error(cli(["--config", str(bad_yaml)]), "not valid YAML")
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("# caf\xe9\nmodel:\n  layers: 2\n".encode("latin-1"))
    assert_one_line_error(cli(["--config", str(latin1)]), "latin1.yaml: unreadable", "UTF-8")
    # tp*pp*dp against the launcher's world size, checked before any process group is joined
    assert_one_line_error(cli(["--config", "configs/tiny.yaml", "--set", "parallel.dp=2"],
                              {"RANK": "0", "WORLD_SIZE": "3", "MASTER_PORT": "1"}),
                          "does not match the world size 3")
    # several nodes: a rank that fails alone (a path missing on its node) must say so in its node's log; only
    # one process per node speaks, rank 0 for the whole job
    args = ["--config", "configs/tiny.yaml", "--set", "data.paths=[/only/on/node0]"]
    other_node = cli(args, {"RANK": "8", "LOCAL_RANK": "0", "WORLD_SIZE": "16"})
    assert other_node.returncode == 2 and other_node.stderr.startswith("error (rank 8, ")
    assert len(other_node.stderr.strip().splitlines()) == 1 and "/only/on/node0" in other_node.stderr
    quiet = cli(args, {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "16"})
    assert quiet.returncode == 2 and quiet.stderr == ""
    # a dry run under a launcher checks the world it would get, also with dp set (gpt13b: 4 x 2 x 8 = 64)
    assert_one_line_error(cli(["--config", "configs/gpt13b.yaml", "--dry-run"],
                              {"SLURM_PROCID": "0", "SLURM_NTASKS": "16"}), "does not match the world size 16")


def test_every_numeric_key_has_a_range():
    """A numeric key without bounds is how a seed of 2**64 or a bucket of 1e308 MB reached torch as a traceback."""
    import dataclasses

    from megazero.config.schema import SECTIONS as _SECTION_CLASSES
    from megazero.config.ranges import _CHOICES, _MAX, _MIN, _PROBABILITY

    for section, cls in _SECTION_CLASSES.items():
        for f in dataclasses.fields(cls):
            ann = str(f.type)
            if not (ann.startswith("int") or ann.startswith("float") or "[int" in ann or "[float" in ann):
                continue
            key = (section, f.name)
            bounded = (key in _MIN and key in _MAX) or key in _PROBABILITY or key in _CHOICES
            assert bounded, f"{section}.{f.name} has no range in megazero.config.ranges"


def test_strict_types_and_empty_sections(tmp_path):
    """Behaviour that changed with the YAML 1.2 loader: a quoted number is a string (no longer read as a
    float), an empty file or a section with every key commented out gives the defaults, and a file holding
    a scalar such as 0 is refused (it used to mean the defaults)."""
    with pytest.raises(UserError, match=r"train.lr='1e-3' is invalid; expected a finite number"):
        load_config(None, ["train.lr='1e-3'"])
    assert load_config(write(tmp_path, "# nothing yet\n")).train.steps == 100
    assert load_config(write(tmp_path, "train:\n  # steps: 5\n")).train.steps == 100
    with pytest.raises(UserError, match="holds 0; expected a mapping of sections"):
        load_config(write(tmp_path, "0\n"))


def test_apply_keeps_its_meaning_for_checkpoint_metadata():
    """megazero.config.load.apply_value types one value (checkpoint-metadata validation calls it); ranges._MIN
    and _MAX range it."""
    from megazero.config.schema import Config
    from megazero.config.load import apply_value
    from megazero.config.ranges import _MAX, _MIN

    cfg = Config()
    apply_value(cfg, "train", "steps", 5, "ckpt/meta.json")
    assert cfg.train.steps == 5 and _MIN[("train", "steps")] == 1 and _MAX[("train", "seed")] == 2 ** 63 - 1
    with pytest.raises(UserError, match=r"ckpt/meta.json: train.steps='5' is invalid; expected an integer"):
        apply_value(cfg, "train", "steps", "5", "ckpt/meta.json")


def _runtime_imports(path: Path) -> list[tuple[str, bool]]:
    """(module, inside a function) for each import of a file, but those under ``if TYPE_CHECKING:`` (types only).
    ``from a import b`` gives ``a`` and, where b is a module, ``a.b``."""
    import ast

    found: list[tuple[str, bool]] = []

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", None) == "TYPE_CHECKING":
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                found.append((child.module, in_function))
                found.extend((f"{child.module}.{a.name}", in_function) for a in child.names)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text()), False)
    return found


def _module_file(name: str) -> Path | None:
    parts = name.split(".")
    if parts[:1] == ["megazero"] and parts[1:2] and parts[1] in ("models", "parallel", "kernels"):
        parts = parts[1:]  # the folders at the tree's top that are installed as megazero.<folder>
    base = ROOT.joinpath(*parts)
    return next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()), None)


def test_config_and_rules_import_one_way():
    """config -> rules -> errors, with no circle: nothing megazero.config.rules imports (transitively, lazily or not,
    packages included) imports megazero.config.load; config imports rules at the top, not inside a function."""
    seen, todo = set(), ["megazero.config.rules"]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__ too
            module = ".".join(parts[:i])
            path = _module_file(module)
            if path is None or module in seen:
                continue
            seen.add(module)
            todo.extend(m for m, _ in _runtime_imports(path) if m.split(".")[0] == "megazero")
    assert "megazero.config.load" not in seen, sorted(seen)
    assert {"megazero.errors", "megazero.data.samples", "megazero.parallel.schedules"} <= seen  # the real parsers
    config = _runtime_imports(ROOT / "megazero" / "config" / "load.py")
    assert ("megazero.config.rules", False) in config and not [m for m, lazy in config if lazy and "rules" in m]


def test_reshard_after_forward_defaults_by_pipeline():
    """auto = reshard without a pipeline, keep layers gathered with one (2m gathers per layer and step
    otherwise); resolve leaves a bool for the trainer; an explicit value is kept."""
    for pp, want in ((1, True), (2, False), (4, False)):
        cfg = load_config(None, [f"parallel.pp={pp}", "model.layers=4"])
        assert cfg.zero.reshard_after_forward == "auto"
        assert resolve(cfg, pp, "cpu").zero.reshard_after_forward is want
    for pp, explicit in ((1, False), (2, True)):
        cfg = load_config(None, [f"parallel.pp={pp}", f"zero.reshard_after_forward={str(explicit).lower()}"])
        assert resolve(cfg, pp, "cpu").zero.reshard_after_forward is explicit
    with pytest.raises(UserError, match=r"zero.reshard_after_forward='sometimes' is invalid; expected true or "
                                        r"false or 'auto'"):
        load_config(None, ["zero.reshard_after_forward=sometimes"])


def test_split_is_checked_by_the_data_parser():
    """The rules call megazero.data.samples.parse_split: what a config accepts, the data loader accepts.
    A validation weight of 0 is no validation set, fine while nothing evaluates."""
    from megazero.data.samples import parse_split

    assert load_config(None, ["data.split=100,0"]).data.split == "100,0" and parse_split("100,0") == (1.0, 0.0)
    for bad in ("1e308,1e308", "0,1", "1,-1", "98", "inf,1"):
        with pytest.raises(UserError) as from_config:
            load_config(None, [f"data.split='{bad}'"])
        with pytest.raises(UserError) as from_data:
            parse_split(bad)
        assert str(from_config.value) == f"<defaults>: {from_data.value}"

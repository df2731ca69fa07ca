"""The engine builder is the one assembler, and the one architecture comparison behaves as both callers need."""
from __future__ import annotations

import re
from pathlib import Path

from megazero.checkpoint.architecture import architecture_differences, model_differences
from megazero.config.schema import ModelConfig
from megazero.interop.hf_layout import model_config

ROOT = Path(__file__).resolve().parents[2]
CONSTRUCTED = re.compile(r"\b(ZeroOptimizer|PipelineExecutor|LossScaler)\(")
# the builder, and the unit tests whose subject is one of the three classes
ALLOWED = ("megazero/engine/", "tests/parallel/test_zero.py", "tests/parallel/test_zero_memory.py",
           "tests/engine/test_engine_build.py")
SKIPPED = (".venv", ".git", "build", "dist")


def constructions(root: Path) -> list[str]:
    """'path:line' of every construction of the three engine parts outside the allowed files."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.split("/")[0] in SKIPPED or rel.startswith(ALLOWED):
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if CONSTRUCTED.search(line) and "class " not in line:
                found.append(f"{rel}:{i}")
    return found


def test_only_the_builder_constructs_zero_the_executor_and_the_scaler():
    """grep for ZeroOptimizer( / PipelineExecutor( / LossScaler( finds them only in megazero/engine/ and their
    unit tests: the trainer, --simulate, the test helpers and every bench get their engine from the builder."""
    assert constructions(ROOT) == []


def test_the_scan_sees_a_construction(tmp_path):
    """The scan is not vacuous: a hand-assembled executor in a bench file is reported."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "b.py").write_text("x = 1\nexecutor = PipelineExecutor(chunks, grid)\n")
    (tmp_path / "megazero" / "engine").mkdir(parents=True)
    (tmp_path / "megazero" / "engine" / "build.py").write_text("z = ZeroOptimizer(chunks)\n")
    assert constructions(tmp_path) == ["bench/b.py:2"]


def _model(**values) -> ModelConfig:
    sizes = {"layers": 2, "hidden": 64, "heads": 4, "seq_len": 32, "vocab_size": 512}
    return model_config(ModelConfig(**{**sizes, **values}))


def test_the_architecture_comparison_reads_resolved_meanings():
    """kv_heads unset is kv_heads = heads; GPT-2 has no rotary positions; unscaled rotary positions ignore the
    scaling's parameters; everything else that differs is named, with both values."""
    gpt2 = _model()
    keys = ModelConfig.ARCHITECTURE
    assert model_differences(_model(kv_heads=4), gpt2, keys) == []
    assert model_differences(_model(rope_theta=5e5), gpt2, keys) == []
    assert model_differences(_model(layers=3, kv_heads=2), gpt2, keys) == [("layers", 3, 2), ("kv_heads", 2, 4)]
    llama = _model(arch="llama")
    assert model_differences(_model(arch="llama", rope_factor=4.0), llama, keys) == []
    assert model_differences(_model(arch="llama", rope_theta=5e5), llama, keys) == \
        [("rope_theta", 5e5, llama.rope_theta)]
    scaled = _model(arch="llama", rope_scaling="llama3", rope_factor=2.0)
    assert [d[0] for d in model_differences(scaled, llama, keys)] == ["rope_scaling"]
    assert [d[0] for d in model_differences(_model(arch="llama", rope_scaling="llama3"), scaled, keys)] == \
        ["rope_factor"]
    # a Hugging Face folder's model: only the keys it gives are compared
    assert architecture_differences({"arch": "llama", "hidden": 64}, llama) == []
    assert architecture_differences({"hidden": 128, "bias": "attention_bias=true, mlp_bias=false"}, llama) == \
        [("hidden", 128, 64), ("bias", "attention_bias=true, mlp_bias=false", False)]

"""A model config is typed where it is read: no function in models/, megazero/costs.py or megazero/plan/ takes
a parameter named like a config (``cfg``, ``model_cfg``, ``m``, ...) annotated ``Any``; they take ``ModelConfig``
(or the whole ``Config``, imported under TYPE_CHECKING). Parsed with ``ast``, nothing imported."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG_NAMES = ("cfg", "model_cfg", "m", "config", "model_config")


def _is_any(annotation: ast.expr) -> bool:
    text = annotation.value if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str) \
        else ast.unparse(annotation)
    return text.strip() in ("Any", "typing.Any", "Optional[Any]", "Any | None")


def untyped_configs(source: str, filename: str = "<source>") -> list[str]:
    """``file:line function(parameter)`` for each config-named parameter annotated Any."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        a = node.args
        for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs):
            if arg.arg in CONFIG_NAMES and arg.annotation is not None and _is_any(arg.annotation):
                found.append(f"{filename}:{node.lineno} {getattr(node, 'name', 'lambda')}({arg.arg})")
    return found


def _checked_files() -> list[Path]:
    return [*sorted((ROOT / "models").glob("*.py")), ROOT / "megazero" / "costs.py",
            *sorted((ROOT / "megazero" / "plan").glob("*.py"))]


def test_the_checker_finds_an_untyped_config() -> None:
    source = ("def f(cfg: Any, x: Any) -> None: ...\n"
              "def g(m: 'Any', *, model_cfg: typing.Any) -> None: ...\n"
              "class C:\n    def __init__(self, cfg: ModelConfig, m: Config, other: Any): ...\n")
    assert untyped_configs(source) == ["<source>:1 f(cfg)", "<source>:2 g(m)", "<source>:2 g(model_cfg)"]


def test_model_configs_are_typed_in_models_costs_and_plan() -> None:
    files = _checked_files()
    assert len(files) > 20 and all(p.is_file() for p in files), files
    found = [f for path in files
             for f in untyped_configs(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))]
    assert not found, "annotate these ModelConfig (or Config under TYPE_CHECKING):\n" + "\n".join(found)

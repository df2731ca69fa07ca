"""Nothing outside models/ compares an architecture's name: it asks the spec (``cfg.spec``, ``models.registry``).

Every .py file outside models/ and tests/ is parsed with ``ast`` (nothing imported) and a comparison (==, !=, in,
not in) between an operand called ``arch`` or ``model_type`` — a name, an attribute (``m.arch``) or
``getattr(x, "arch", ...)`` — and a string literal (or a tuple, list or set of them) is a finding.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("arch", "model_type")  # what holds an architecture's or a Hugging Face model's name
SKIPPED = ("models", "tests")  # models/ holds the specs; tests compare what they built


def _names_an_architecture(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in NAMES
    if isinstance(node, ast.Attribute):
        return node.attr in NAMES
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
        return len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in NAMES
    return False


def _is_string_literal(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and any(_is_string_literal(e) for e in node.elts)
    return False


def arch_comparisons(source: str, filename: str = "<source>") -> list[str]:
    """``file:line`` and the code of each comparison of an architecture's name with a string literal."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for op, (a, b) in zip(node.ops, zip(operands, operands[1:])):
            if not isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
                continue
            if (_names_an_architecture(a) and _is_string_literal(b)) or (
                    _names_an_architecture(b) and _is_string_literal(a)) or (
                    # a chain: m.arch == there == "gpt2"
                    any(_names_an_architecture(o) for o in operands) and _is_string_literal(b)):
                found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
                break
    return found


def _project_files() -> list[Path]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in SKIPPED or any(p.startswith(".") for p in rel.parts) or "site-packages" in rel.parts:
            continue
        out.append(path)
    return out


def test_the_checker_finds_every_form() -> None:
    source = (
        'if m.arch == "llama": pass\n'
        'ok = arch in ("mixtral", "qwen3_moe")\n'
        'bad = getattr(cfg, "arch", "gpt2") == "llama"\n'
        'x = "gpt2" != model_type\n'
        'y = here.arch == there.get("arch") == "gpt2"\n'
        'z = kind not in ["llama"] or self.model_type in {"qwen3"}\n'
        # not findings: no literal, another name, an ordering
        'a = m.arch == other.arch\n'
        'b = name == "llama"\n'
        'c = spec.learned_positions\n'
    )
    found = arch_comparisons(source)
    assert [int(f.split(":")[1]) for f in found] == [1, 2, 3, 4, 5, 6], found


def test_no_architecture_name_is_compared_outside_models() -> None:
    files = _project_files()
    assert any(p.relative_to(ROOT).parts[0] == "megazero" for p in files) and len(files) > 50, len(files)
    found = [f for path in files
             for f in arch_comparisons(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))]
    assert not found, "ask the architecture's spec (cfg.spec, models.registry) instead:\n" + "\n".join(found)

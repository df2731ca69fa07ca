"""A refused kernels.* value is the project's one input error, raised by the kernels themselves: UserError lives
on the lowest floor (kernels.errors), megazero.errors re-exports it, and importing it loads no torch."""
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megazero.kernels.choice import resolve_kernels
from megazero.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


def test_a_refusal_is_a_one_line_user_error():
    cfg = SimpleNamespace(adam="apex", norm="auto", attention="auto")
    with pytest.raises(UserError) as err:
        resolve_kernels(cfg, "cpu")
    assert str(err.value) == "kernels.adam='apex' is not an AdamW implementation; valid: auto | fused | torch | triton"
    cfg = SimpleNamespace(adam="auto", norm="apex", attention="auto")
    with pytest.raises(UserError, match=r"^kernels.norm='apex' is not a norm implementation; valid: "
                                        r"auto \| torch \| triton$"):
        resolve_kernels(cfg, "cpu")
    cfg = SimpleNamespace(adam="auto", norm="auto", attention="flash")
    with pytest.raises(UserError, match=r"^kernels.attention='flash' is not an attention implementation; valid: "
                                        r"auto \| torch \| triton \| blocks$"):
        resolve_kernels(cfg, "cpu")
    cfg = SimpleNamespace(adam="auto", norm="auto", attention="auto")
    resolve_kernels(cfg, "cpu")  # what resolves passes through
    assert (cfg.adam, cfg.norm, cfg.attention) == ("fused", "torch", "torch")


def test_the_error_class_is_one_and_costs_no_torch():
    """megazero's UserError is the kernels' (one class for the CLI to catch), and loading it (as every config
    load does) imports neither torch nor triton."""
    import megazero.kernels.errors

    assert UserError is megazero.kernels.errors.UserError
    code = ("import sys, megazero.errors, megazero.kernels.choice; "
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr

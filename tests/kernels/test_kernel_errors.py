"""A refused kernels.* value: the kernels' own KernelChoiceError (they import nothing from megazero), turned
into megazero's UserError, message unchanged, by ``megazero.errors.as_user_error`` at the entry point."""
from types import SimpleNamespace

import pytest

from kernels import KernelChoiceError, resolve_kernels
from megazero.errors import UserError, as_user_error


def test_a_refusal_is_the_kernels_own_error():
    cfg = SimpleNamespace(adam="apex", attention="auto")
    with pytest.raises(KernelChoiceError) as err:
        resolve_kernels(cfg, "cpu")
    assert isinstance(err.value, ValueError) and not isinstance(err.value, UserError)
    assert str(err.value) == "kernels.adam='apex' is not an AdamW implementation; valid: auto | fused | torch | triton"


def test_as_user_error_keeps_the_one_line_message():
    cfg = SimpleNamespace(adam="auto", attention="flash")
    with pytest.raises(UserError) as err:
        with as_user_error(KernelChoiceError):
            resolve_kernels(cfg, "cpu")
    assert str(err.value) == ("kernels.attention='flash' is not an attention implementation; valid: auto | torch | "
                              "triton")
    assert err.value.__cause__ is None and err.value.__suppress_context__  # no chained traceback to print
    cfg = SimpleNamespace(adam="auto", attention="auto")
    with as_user_error(KernelChoiceError):  # what resolves passes through
        resolve_kernels(cfg, "cpu")
    assert (cfg.adam, cfg.attention) == ("fused", "torch")


def test_as_user_error_leaves_other_errors_alone():
    with pytest.raises(KeyError):
        with as_user_error(KernelChoiceError):
            raise KeyError("not an input error")

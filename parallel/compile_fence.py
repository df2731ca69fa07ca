"""Host bookkeeping that torch.compile must not trace, at no start-up cost when nothing compiles.

``torch.compiler.disable`` imports torch._dynamo as it decorates: about 1.3 s of a 2-core machine's start-up, paid
by every process (a dry run, a config error, each torchrun worker) whether it compiles or not. ``host_only`` leaves
the function plain outside compilation; under it, the call goes through torch's own lazy form of the same
decorator (``torch._disable_dynamo``, which imports dynamo on its first call, from a module dynamo never inlines),
so a traced block still breaks its graph there and runs the bookkeeping eagerly.
"""
from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def host_only(fn: F) -> F:
    """``fn`` run eagerly, never traced: its running totals would be guards that recompile per call."""
    fenced = torch._disable_dynamo(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return fenced(*args, **kwargs)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]

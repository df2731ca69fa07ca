"""parallel/compile_fence.py: the host bookkeeping of a collective runs eagerly inside a compiled function (every
call counted, with its own sizes), and a process that never compiles never imports torch._dynamo (~1.3 s of every
start on 2 cores: a dry run took 3.3 s with it and 1.9 s without)."""
from __future__ import annotations

import subprocess
import sys

import torch

from megazero.parallel.compile_fence import host_only
from tests.runs import ROOT


class Tally:
    def __init__(self) -> None:
        self.calls, self.elements = 0, 0

    @host_only
    def record(self, tensor: torch.Tensor) -> None:
        self.calls += 1
        self.elements += tensor.numel()


def test_a_compiled_caller_counts_every_call_with_its_size():
    tally = Tally()

    def step(x):
        y = x * 2
        tally.record(y)
        return y.sin() + 1

    compiled = torch.compile(step, backend="eager")
    for i in range(6):
        x = torch.randn(4 + i % 2)
        torch.testing.assert_close(compiled(x), step(x), rtol=0, atol=0)
    # 12 calls: 6 compiled and 6 eager; 4 and 5 elements alternately, twice over
    assert (tally.calls, tally.elements) == (12, 54)


def test_a_run_that_never_compiles_does_not_import_dynamo():
    code = ("import sys, megazero.train.run, megazero.parallel.comm, megazero.engine.build; "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"

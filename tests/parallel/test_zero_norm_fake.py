"""The gradient norm on fake tensors (``pretrain.py --simulate``): one norm per run instead of one per
NORM_PIECE elements, with the pieces' shapes kept, and the real tensors' norm still taken piece by piece."""
from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from megazero.parallel.zero.adamw import NORM_PIECE, ShardedAdamW


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _norm(grads: list[torch.Tensor], counted: list) -> tuple[torch.Tensor, SimpleNamespace, Counter]:
    owner = SimpleNamespace(device=torch.device("cpu"), norm_weights={})
    with _Ops() as ops:
        got = ShardedAdamW.counted_sq_norm(owner, grads, counted, "range")
    return got, owner, ops.ops


def test_fake_gradients_take_one_norm_per_run_with_the_pieces_shapes():
    """Two buckets of 10 and 3 pieces (runs of 10.5 and 3 pieces' elements, one not counted): on fake tensors
    the slices are one per run, not one per piece, and the weights (kept across steps) and the result have
    the real path's shapes; on real tensors the norm is still cut into pieces and equals the float64 sum."""
    sizes = (10 * NORM_PIECE + NORM_PIECE // 2, 3 * NORM_PIECE)
    counted = [[(0, sizes[0], True)], [(0, NORM_PIECE, True), (NORM_PIECE, sizes[1], False)]]
    pieces = 11 + 1 + 2
    with FakeTensorMode():
        fake = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
        got, owner, ops = _norm(fake, counted)
    assert ops["aten.slice.Tensor"] == 3, ops
    assert got.shape == () and got.dtype == torch.float32
    assert owner.norm_weights["range"].shape == (pieces,)

    real = [torch.randn(n, dtype=torch.float32) for n in sizes]
    got, owner, ops = _norm(real, counted)
    assert ops["aten.slice.Tensor"] == pieces, ops
    want = real[0].double().square().sum() + real[1][:NORM_PIECE].double().square().sum()
    assert torch.allclose(got.double(), want, rtol=1e-6), (got, want)

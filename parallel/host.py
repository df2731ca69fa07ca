"""Device values read on the host: the few places a step waits for the device go through here.

Under ``pretrain.py --simulate`` the tensors are fake (torch's FakeTensorMode: shapes, no values), so a read
has nothing to return. Each value then reads as 0 (finite, nothing flagged, no clipping) and the step takes
its ordinary path: the simulation runs the code a real run runs.
"""
from __future__ import annotations

from torch import Tensor
from torch._subclasses.fake_tensor import is_fake


def host_values(t: Tensor) -> list[float]:
    """The values of ``t``, flattened, as Python numbers (0 for each under fake tensors)."""
    if is_fake(t):
        return [0.0] * t.numel()
    return t.reshape(-1).tolist()

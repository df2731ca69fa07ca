"""What an optimizer adds to a pipeline stage's step beyond the elementwise update: exchanges among the stage's
ranks and FLOPs of its own. An optimizer's registry row (``parallel.zero.registry``, ``plan_step``) computes
it; the step-time model prices it and the dry run's table names it."""
from __future__ import annotations

from dataclasses import dataclass

# the optimizers' extra FLOPs run in fp32 without tensor cores: an H100/H200's 67 TFLOP/s of its 989 dense bf16
FP32_SHARE = 67 / 989


@dataclass(frozen=True)
class OptimizerStep:
    """A stage rank's extra optimizer work per step."""

    sent: int  # bytes a rank sends in the optimizer's all-to-alls (its own pieces included), on average
    calls: int  # all-to-alls over the stage's dp x cp x tp ranks
    flops: float  # fp32 FLOPs on this rank
    transient: int = 0  # bytes alive at once for its largest piece of work
    what: str = ""  # what is exchanged and computed, for the dry run's note
    source: str = ""  # the module that counts it

    @staticmethod
    def none() -> "OptimizerStep":
        return OptimizerStep(0, 0, 0.0)

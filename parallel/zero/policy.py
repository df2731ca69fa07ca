"""What each ZeRO stage shards and when it communicates (Rajbhandari et al., SC'20, section 5).

The stages differ in a handful of decisions; each is a named field here, derived once from the stage, and
the parts of ``parallel.zero`` read these names, never the stage number.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StagePolicy:
    stage: int
    shard_optimizer: bool  # fp32 masters and Adam moments only for this dp rank's slice (P_os)
    shard_grads: bool  # a microbatch's full bucket gradient lives only until it is reduce-scattered (P_g)
    shard_params: bool  # parameters exist whole only around a layer's forward and backward (P_p)
    reduce_every_microbatch: bool  # reduce each microbatch's bucket gradient, not only the last's sum
    gather_after_step: bool  # every rank updated its slice: all-gather the parameters for the next forward
    bound_in_flight: bool  # reductions read transient buffers: keep only a few alive (memory flat in m)

    @classmethod
    def of(cls, stage: int) -> "StagePolicy":
        assert stage in (0, 1, 2, 3), stage
        return cls(stage=stage, shard_optimizer=stage >= 1, shard_grads=stage >= 2, shard_params=stage == 3,
                   reduce_every_microbatch=stage >= 2, gather_after_step=stage in (1, 2),
                   bound_in_flight=stage >= 2)

    @property
    def shards_updates_only(self) -> bool:
        """Stages 1-2: the optimizer's states sharded (at 2 the gradients too), the parameters whole: a step's
        traffic is a reduce-scatter and an all-gather at both, which the step-time model times alike."""
        return self.shard_optimizer and not self.shard_params

    @property
    def keeps_full_grads(self) -> bool:
        """Stages 0-1 accumulate every microbatch into one whole gradient buffer per bucket and reduce once."""
        return not self.shard_grads

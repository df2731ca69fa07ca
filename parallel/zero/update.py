"""What ZeRO asks of an optimizer: the ``Update`` one partition's states go through, and what its factory is given.

A ZeRO partition (``parallel.zero.partition``) hands its update the buckets once (``add_bucket``), each reduced
gradient as it becomes final (``grad_ready``), then per step asks for the norm (``sq_norm``) and the step
(``update``). The checkpoint reads and writes the states AdamW's way, a bucket at a time (``bucket_states``: master,
exp_avg, exp_avg_sq; None for a kind the update does not keep), so every optimizer's checkpoint is layout-free. Optional abilities are
declared here with their neutral answers rather than probed: per-rank state (``rank_state``, 1-bit Adam's error
feedback), the figures for the metrics (``record``). An optimizer is a class that fulfils this Protocol plus a
row in ``parallel.zero.registry``; it need not derive from ``ShardedAdamW``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Protocol

import torch
from torch import Tensor, nn

from megazero.kernels.adam_cpu import Run
from megazero.parallel.comm import Comm
from megazero.parallel.topology import Grid
from megazero.parallel.zero.layout import Bucket, BucketLayout

if TYPE_CHECKING:
    from megazero.parallel.zero.nvme_adamw import NvmeSettings


@dataclass(frozen=True)
class UpdateContext:
    """What a factory builds one partition's update from (``registry.Row.factory(section, context)``)."""

    layout: BucketLayout  # the partition's buckets; ``layout.range(b)`` is this rank's share
    comm: Comm  # the group the partition's gradients are reduced and its states sharded over
    grid: Grid  # the topology (tp, the stage's ranks)
    chunks: list[nn.Module]  # the stage's model chunks (what they declare: layers, matrices)
    experts: bool  # the experts' partition (ep > 1) rather than the dense one
    device: torch.device  # where the model computes
    state_device: torch.device  # where the states live (the host when offloaded)
    grad_dtype: torch.dtype  # the reduced gradients' dtype
    weight_decay: float  # decoupled, on the runs the layout marks as decaying
    adam_impl: str  # kernels.adam's choice for an elementwise Adam step
    peak_lr: float  # train.lr, the peak each step's learning rate is scheduled from (Muon's adamw_lr is a ratio of it)
    nvme: Optional["NvmeSettings"] = None  # zero.offload_optimizer=nvme: where the states' scratch file goes
    last_step: int = 0  # train.steps, the run's last step (0: not known)
    run_step: Callable[[], int] = lambda: 0  # the train step being taken (skipped ones counted, unlike step_count)


@dataclass(frozen=True)
class Record:
    """One partition's figures for the metrics: ``values`` (float64, on the device) combined over the partitions
    and then over the world with ``op`` ("sum" or "max"; "local": not over the world), and turned into named
    figures by ``finish`` from the combined values as Python numbers. ``per_value``: for "local", each value's
    own combination over the partitions ("sum" or "max"; a byte count sums, a largest ratio does not)."""

    values: Tensor
    op: str
    finish: Callable[[list[float]], dict[str, float]]
    per_value: tuple[str, ...] = ()


def over_partitions(records: list[Record], device: torch.device) -> Tensor:
    """The partitions' values combined: by ``op`` (max, or else sum), or value by value as ``per_value`` says."""
    both = torch.stack([r.values.to(device=device, dtype=torch.float64) for r in records])
    ops = records[0].per_value or ("max" if records[0].op == "max" else "sum",) * both.shape[1]
    assert len(ops) == both.shape[1] and all(r.per_value == records[0].per_value for r in records), records
    return torch.stack([both[:, j].amax() if op == "max" else both[:, j].sum() for j, op in enumerate(ops)])


class Update(Protocol):
    """One partition's optimizer on this rank's share of the flat buffers."""

    step_count: int  # updates made (a checkpoint sets it on a load)
    master: list[Optional[Tensor]]  # per bucket: the fp32 values the update writes
    master_is_param: list[bool]  # per bucket: the master is the parameter slice itself (no copy back)
    exp_avg: list[Optional[Tensor]]  # per bucket: the first moment (None where the update keeps none)
    exp_avg_sq: list[Optional[Tensor]]  # per bucket: the second moment (None where the update keeps none)

    def add_bucket(self, b: Bucket, initial: Tensor, decay: list[Run], count: list[Run]) -> None:
        """The states of one bucket's range from its fp32 initial values, its decay and norm runs."""

    def grad_ready(self, b: Bucket, grad: Tensor) -> None:
        """A bucket's reduced gradient is final (an offloaded update starts its host copy)."""

    def discard(self) -> None:
        """A skipped step: forget anything taken from this step's gradients."""

    def reads_reduced_gradients(self) -> bool:
        """The next step reads gradients reduced over the partition's group (else they stay local)."""

    def may_read_local_gradients(self) -> bool:
        """Some step may read local, whole-bucket gradients (the finalizer then keeps whole-bucket runs)."""

    def wrote_whole_params(self) -> bool:
        """The last step wrote this rank's whole parameters itself (0/1 Adam's local steps): no gather after it."""

    def states_loaded(self) -> None:
        """A checkpoint has just written the states: rebuild what derives from them."""

    def sq_norm(self, grads: list[Tensor]) -> Tensor:
        """Sum of squares of the gradients that count toward the global norm, on this rank."""

    def first_nonfinite(self, grads: list[Tensor]) -> Optional[str]:
        """The first parameter with a non-finite gradient element in this rank's share (None: all finite)."""

    def update(self, grads: list[Tensor], lr: float, grad_scale: float, resend: set[int]) -> None:
        """One step; ``grad_scale`` folds unscaling and clipping; ``resend``: buckets changed after grad_ready."""

    def offloaded(self) -> bool:
        """The states live on the host."""

    def state_bytes(self) -> int:
        """Bytes of the update's own states (what the dry run plans)."""

    def bucket_states(self, i: int) -> dict[str, Optional[Tensor]]:
        """Bucket i's master, exp_avg and exp_avg_sq over this rank's range, for a save (None: not kept)."""

    def load_bucket_states(self, i: int, states: dict[str, Tensor]) -> None:
        """A checkpoint's master, exp_avg and exp_avg_sq of bucket i, written where the update keeps them."""

    def disk_bytes(self) -> int:
        """Bytes of the states on a local disk (zero.offload_optimizer=nvme)."""

    def close(self) -> None:
        """Release what the states hold outside the process's tensors (a scratch file)."""

    def staging_bytes(self) -> int:
        """Bytes of host buffers the gradients land in when offloaded."""

    def state_tensors(self) -> list[Tensor]:
        """Every tensor the update keeps across steps (for a memory tracker to name)."""

    def staging_tensors(self) -> list[Tensor]:
        """The host landing buffers of the gradients (offloaded)."""

    def rank_state(self, step: int) -> dict[str, Tensor]:
        """What belongs to this rank alone as of optimizer step ``step``, by key (most updates: nothing)."""

    def rebuild_rank_state(self, key: str, step: int) -> bool:
        """A checkpoint written by an older megazero lacks ``key`` of ``rank_state``: rebuild it from the step if
        it can be (True), or say it cannot (False: the resume is refused)."""

    def record(self) -> Optional[Record]:
        """The last step's figures for the metrics (None: the update reports none)."""

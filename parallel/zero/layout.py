"""ZeRO's flat buffers: the stage's parameters as contiguous, dp-padded buckets in backward order.

Every bucket is padded to a multiple of dp, so dp rank r owns the same contiguous slice
[r·n/dp, (r+1)·n/dp) of every bucket; parameters are views into the bucket's buffer. Buckets are cut by
size (``zero.bucket_mb``, counted in the gradient dtype's bytes, since the gradient buffer is what a
reduction moves) or, when parameters are sharded (stage 3), one per sharding unit the model declares (its
transformer layers) plus a root bucket for the rest (``parallel.zero.declared``). Tied parameters (a stage's
copy of another stage's embedding) get a bucket of their own, reduced after the schedule when both copies'
gradients are in. Pure layout and parameter memory: no communication.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import Tensor, nn

from megazero.kernels.adam_cpu import Run
from megazero.parallel.zero.declared import sharding_units, tied_parameters
from megazero.parallel.zero.policy import StagePolicy

if TYPE_CHECKING:
    from megazero.parallel.zero.nvme_params import NvmeParams


@dataclass
class Bucket:
    """A contiguous piece of the parameter buffer and what is reduced, gathered or updated with it."""

    index: int
    params: list  # [(global name, Parameter)]
    offsets: list  # element offset of each parameter in the bucket
    numel: int  # padded to a multiple of dp
    dp: int
    unit: Optional[nn.Module] = None  # shard_params: the sharding unit (layer) whose parameters these are
    deferred: bool = False  # reduced after the schedule (tied copies, stage 3's root)
    chunk: int = 0  # shard_params: the model chunk (virtual stage) the layer belongs to
    full: Tensor = None  # the parameters (shard_params: storage freed while not gathered)
    shard_param: Optional[Tensor] = None  # shard_params: this rank's slice, the persistent copy
    tied: dict = field(default_factory=dict)  # position in params -> counts toward the norm, for tied copies

    @property
    def shard(self) -> int:
        return self.numel // self.dp

    def names(self) -> str:
        return ", ".join(n for n, _ in self.params)


class BucketLayout:
    """Builds the buckets of ``chunks`` and owns the parameter memory; ``range(b)`` is the optimizer's range."""

    def __init__(self, chunks: list[nn.Module], policy: StagePolicy, dp: int, dp_rank: int, dtype: torch.dtype,
                 grad_dtype: torch.dtype, bucket_mb: float, device: torch.device,
                 param_device: Optional[torch.device] = None,
                 select: Optional[Callable[[nn.Parameter], bool]] = None):
        """select: the parameters of ``chunks`` this layout holds (default all): those that reduce over the
        group whose size and rank are ``dp`` and ``dp_rank`` (``parallel.zero.declared.reduce_group``)."""
        self.policy, self.dp, self.dp_rank = policy, dp, dp_rank
        self.chunks, self.dtype, self.device = chunks, dtype, device
        self.param_device = param_device if param_device is not None else device
        self.param_disk: Optional["NvmeParams"] = None  # zero.offload_params=nvme: the shards' file (set before
        # materialise)
        frozen = [n for c in chunks for n, p in c.named_parameters() if not p.requires_grad and
                  (select is None or select(p))]
        if frozen:  # its bucket would wait forever for a gradient (and never be reduced)
            raise ValueError(f"ZeroOptimizer trains every parameter it is given; frozen: {', '.join(frozen)}")
        tied = tied_parameters(chunks)
        limit = max(1, int(bucket_mb * 2 ** 20 / torch.tensor([], dtype=grad_dtype).element_size()))
        # padding to a multiple of dp is part of the bucket too: a bucket holds at most bucket_mb
        limit = max(1, limit - (dp - 1))
        keep = select if select is not None else (lambda p: True)
        groups = _by_unit(chunks, keep) if policy.shard_params else _by_size(chunks, limit, tied, keep)
        self.buckets: list[Bucket] = []
        for params, unit, deferred, chunk in groups:
            offsets, total = [], 0
            for _, p in params:
                offsets.append(total)
                total += p.numel()
            mine = {j: tied[id(p)] for j, (_, p) in enumerate(params) if id(p) in tied}
            # a tied copy is summed with the other stage's before its bucket's reduction: after the schedule
            assert deferred or not mine, f"tied parameters inside a sharding unit: {[params[j][0] for j in mine]}"
            self.buckets.append(Bucket(index=len(self.buckets), params=params, offsets=offsets,
                                       numel=-(-total // dp) * dp, dp=dp, unit=unit, deferred=deferred,
                                       chunk=chunk, tied=mine))
        self.owner = self._checkpoint_owners()

    def range(self, b: Bucket) -> tuple[int, int]:
        """The optimizer's range of a bucket on this rank: all of it (unsharded optimizer) or the own slice."""
        if not self.policy.shard_optimizer:
            return 0, b.numel
        return self.dp_rank * b.shard, (self.dp_rank + 1) * b.shard

    def shard_values(self, b: Bucket) -> Tensor:
        """Stage 3: this rank's shard of the bucket, to read (from the disk, in a buffer of its own, when there)."""
        return self.param_disk.take(b) if self.param_disk is not None else b.shard_param

    def set_shard(self, b: Bucket, values: Tensor) -> None:
        """Stage 3: replace this rank's shard of the bucket (a checkpoint's values)."""
        if self.param_disk is not None:
            self.param_disk.put(b, values)
        else:
            b.shard_param.copy_(values)

    def own_slice(self, b: Bucket) -> tuple[int, int]:
        """This dp rank's slice of a bucket (what it reduces into and gathers from)."""
        return self.dp_rank * b.shard, (self.dp_rank + 1) * b.shard

    def materialise(self, initial_value: Optional[Callable[[nn.Parameter], Tensor]],
                    on_bucket: Callable[[Bucket, Tensor], None]) -> None:
        """Move the parameters into the bucket buffers, one bucket at a time; ``on_bucket(b, values)`` gets the
        fp32 initial values of the optimizer's range (its masters start from them, before any rounding).

        Parameters still on the meta device are created from ``initial_value(param)`` (DeepSpeed's zero.Init):
        with sharded parameters only the bucket being filled is ever whole, and it is freed right after."""
        for b in self.buckets:
            lo, hi = self.range(b)
            master = torch.zeros(hi - lo, dtype=torch.float32, device=self.device)
            b.full = torch.zeros(b.numel, dtype=self.dtype, device=self.device)
            for j, ((name, p), off) in enumerate(zip(b.params, b.offsets)):
                n = p.numel()
                value = p.detach() if not p.is_meta else initial_value(p)
                flat = value.reshape(-1)
                a, z = max(off, lo), min(off + n, hi)
                if a < z:
                    master[a - lo:z - lo] = flat[a - off:z - off].float()
                b.full[off:off + n] = flat.to(self.dtype)
                # a view of the bucket, in place: the same Parameter object, its attributes kept
                view = b.full[off:off + n].view(p.shape)
                if not p.is_meta:
                    p.data = view
                else:  # a meta parameter cannot take a real tensor as .data: swapped for a new one
                    real = nn.Parameter(view, requires_grad=p.requires_grad)
                    # our attributes (tp_split_dim, ...), not a fake tensor's own (its device, its mode)
                    real.__dict__.update({k: v for k, v in p.__dict__.items() if k not in real.__dict__})
                    if not weakref.getweakrefs(p) and not weakref.getweakrefs(real):
                        torch.utils.swap_tensors(p, real)
                    else:  # fake tensors (--simulate) are weakly referenced, so not swappable: the module takes
                        path, _, attr = name.rpartition(".")  # the new object (owners re-read parameters())
                        setattr(self.chunks[b.chunk].get_submodule(path), attr, real)
                        b.params[j] = (name, real)
                del value, flat
            if self.policy.shard_params:
                b.shard_param = b.full[lo:hi].clone().to(self.param_device)
                if self.device.type == "cuda" and self.param_device.type == "cpu" and self.param_disk is None:
                    b.shard_param = b.shard_param.pin_memory()
            on_bucket(b, master)
            if self.policy.shard_params:
                b.full.untyped_storage().resize_(0)  # gathered again before each use (parallel.zero.gather)
                if self.param_disk is not None:  # to the disk: host memory holds the shards in flight only
                    self.param_disk.add(b)

    def mask_runs(self, b: Bucket, tp_rank: int, whole: bool = False) -> tuple[list[Run], list[Run], list[Run]]:
        """Per element of the optimizer's range, as maximal runs ``(start, end, flag)`` that tile it: (weight
        decay applies, counts toward the gradient norm, sequence-parallel: summed over tp). Matrices decay;
        biases and norms do not. A tp-replicated parameter counts on tp rank 0 only, a piece replicated on r tp
        ranks on the first of them, and a tied copy only where the model declares it counted, so the norm counts
        each once. Padding is False in all three. Computed from the parameters alone (no tensor is read), so a
        simulated run (fake tensors) builds them as a real one. ``whole``: over the whole bucket instead (an
        optimizer that reads the local, unreduced gradient of every bucket: 1-bit Adam past its warm-up)."""
        lo, hi = (0, b.numel) if whole else self.range(b)
        runs: tuple[list[Run], list[Run], list[Run]] = ([], [], [])

        def put(a: int, z: int, flags: tuple[bool, bool, bool]) -> None:
            for out, flag in zip(runs, flags):
                if out and out[-1][2] == flag:
                    out[-1] = (out[-1][0], z, flag)
                else:
                    out.append((a, z, flag))

        at = 0
        for j, ((_, p), off) in enumerate(zip(b.params, b.offsets)):
            a, z = max(off, lo) - lo, min(off + p.numel(), hi) - lo
            if a >= z:
                continue
            if a > at:
                put(at, a, (False, False, False))
            put(a, z, (p.dim() >= 2, counted_on_tp_rank(p, tp_rank) and b.tied.get(j, True),
                       bool(getattr(p, "sequence_parallel", False))))
            at = z
        if at < hi - lo:
            put(at, hi - lo, (False, False, False))
        return runs

    def name_at(self, b: Bucket, at: int) -> Optional[str]:
        """The parameter at element ``at`` of a bucket (None in the padding)."""
        return next((n for (n, p), off in zip(b.params, b.offsets) if off <= at < off + p.numel()), None)

    def _checkpoint_owners(self) -> dict[str, int]:
        """The dp rank that holds each parameter's whole state for a checkpoint: the least loaded so far, in
        bucket order. Every rank of the stage computes the same map (tp ranks too: their shards are equal)."""
        load, owner = [0] * self.dp, {}
        for b in self.buckets:
            for name, p in b.params:
                r = min(range(self.dp), key=lambda i: (load[i], i))
                owner[name] = r
                load[r] += p.numel()
        return owner


def counted_on_tp_rank(p: nn.Parameter, tp_rank: int) -> bool:
    """Whether this tp rank's copy of ``p`` counts toward the gradient norm (each distinct value once)."""
    if getattr(p, "tp_split_dim", None) is None:
        return tp_rank == 0
    return tp_rank % getattr(p, "tp_replicas", 1) == 0


def _by_unit(chunks: list[nn.Module], keep: Callable) -> list[tuple[list, Optional[nn.Module], bool, int]]:
    """One bucket per declared sharding unit, in backward order, and a deferred root bucket per chunk."""
    groups = []
    for c in reversed(range(len(chunks))):
        chunk = chunks[c]
        inside: set[int] = set()
        for prefix, unit in reversed(sharding_units(chunk)):
            # the unit's parameters under their global names, in backward order
            named = [(f"{prefix}.{n}", p) for n, p in unit.named_parameters()]
            inside.update(id(p) for _, p in named)
            named = [(n, p) for n, p in named if keep(p)]
            if named:
                groups.append((named[::-1], unit, False, c))
        root = [(n, p) for n, p in chunk.named_parameters() if id(p) not in inside and keep(p)]
        if root:
            groups.append((root[::-1], None, True, c))
    return groups


def _by_size(chunks: list[nn.Module], limit: int, tied: dict[int, bool],
             keep: Callable) -> list[tuple[list, Optional[nn.Module], bool, int]]:
    """Backward order (last registered first), cut before a bucket would exceed ``limit`` elements (a single
    parameter larger than that is a bucket of its own); the tied copies in a deferred bucket of their own."""
    named = [(n, p) for chunk in chunks for n, p in chunk.named_parameters() if keep(p)][::-1]
    tied_params = [(n, p) for n, p in named if id(p) in tied]
    rest = [(n, p) for n, p in named if id(p) not in tied]
    groups, current, size = [], [], 0
    for n, p in rest:
        if p.numel() > limit:  # a bucket of its own; the open bucket stays open for what follows (else every
            groups.append(([(n, p)], None, False))  # bias between two big matrices would be a bucket alone)
            continue
        if current and size + p.numel() > limit:
            groups.append((current, None, False))
            current, size = [], 0
        current.append((n, p))
        size += p.numel()
    if current:
        groups.append((current, None, False))
    if tied_params:
        groups.append((tied_params, None, True))
    return [(params, unit, deferred, 0) for params, unit, deferred in groups]


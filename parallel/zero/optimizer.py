"""ZeRO data parallelism (Rajbhandari et al., SC'20) composed from its parts.

- ``StagePolicy``: what the stage shards and when it communicates.
- ``BucketLayout``: the flat, dp-padded buckets and the parameter memory.
- ``GradReducer``: backward hooks, microbatch sums, reductions over dp with a bounded number in flight.
- ``GradFinalizer``: the sums beyond dp: tied copies over the embedding group, sequence-parallel over tp.
- ``ParamGatherer``: stage 3's gather/free/prefetch; stages 1-2's overlapped all-gather after the step.
- an ``Update`` (``parallel.zero.update``), one optimizer's step on this rank's share, built per partition by a
  factory of ``parallel.zero.registry``: ``ShardedAdamW`` (fp32 masters, moments, the norm and the update, on the
  device or offloaded), ``ShardedLamb`` (LAMB's per-layer trust ratio), ``ShardedMuon`` (Muon on the layers'
  matrices, each gathered whole to an owner over the stage's ranks: ``parallel.zero.matrix_plan``),
  ``ShardedOnebitAdam`` (AdamW's warm-up, then a frozen variance and the momentum averaged 1-bit compressed).
- ``ZeroCheckpoint``: layout-free export and import of every parameter's state.
- ``Partition``: the parts above for the parameters of one reduction group (dense over dp, experts over edp).

Communication per step and rank in elements on the wire, m = 1 microbatch: 2Ψ(dp−1)/dp for stages
0–2 (all-reduce = reduce-scatter + all-gather), and 3Ψ(dp−1)/dp for stage 3 (two gathers and a
reduce-scatter). ``megazero.engine.step.train_step`` drives one step; nothing else needs to know the order.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megazero.parallel.comm import Comm
from megazero.parallel.host import host_values
from megazero.parallel.topology import Grid
from megazero.parallel.zero.declared import DENSE, EXPERT, reduce_group
from megazero.parallel.zero.grads import grad_precision
from megazero.parallel.zero.layout import Bucket, BucketLayout
from megazero.parallel.zero.nvme_adamw import NvmeSettings, make_adamw_for
from megazero.parallel.zero.nvme_params import NvmeParams
from megazero.parallel.zero.partition import Partition
from megazero.parallel.zero.policy import StagePolicy
from megazero.parallel.zero.registry import AdamWSection
from megazero.parallel.zero.update import over_partitions, Update, UpdateContext

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ZeroOptimizer:
    """The stage's parameters, their gradients' reduction, and one optimizer's update on this rank's share."""

    def __init__(self, chunks: list[nn.Module], grid: Grid, stage: int, precision: str, weight_decay: float,
                 update: Optional[Callable[[UpdateContext], Update]] = None, bucket_mb: float = 25.0,
                 reshard_after_forward: bool = True, offload_optimizer: str = "none", offload_params: str = "none",
                 adam_impl: str = "torch", device: Optional[torch.device] = None,
                 initial_value: Optional[Callable[[nn.Parameter], Tensor]] = None, grad_dtype: str = "auto",
                 overlap_param_gather: bool = True, max_in_flight: int = 2, peak_lr: float = 0.0,
                 nvme: Optional[NvmeSettings] = None, last_step: int = 0):
        """device: where the model computes (default: where its parameters are). Parameters still on the meta
        device (stage 3's lazily built model) are created bucket by bucket from ``initial_value(param)``, so
        the whole stage never exists unsharded. ``update``: builds each partition's optimizer from its context (a
        registry row's factory bound to its config section, ``megazero.engine.build.make_zero``; default AdamW);
        ``peak_lr``: train.lr, which each step's learning rate is a schedule of (an update's relative rates);
        ``nvme``: with ``offload_optimizer="nvme"``, where the states' scratch file goes and its host buffers;
        ``last_step``: train.steps (0: not known), which an update may treat apart (0/1 Adam synchronises there)."""
        self.grid = grid
        self.policy = StagePolicy.of(stage)
        self.run_step = 0  # train steps taken, skipped ones included (an update's step count leaves them out)
        self.dtype = DTYPES[precision]
        self.grad_dtype = DTYPES[grad_precision(precision, grad_dtype)]  # microbatch sums and dp reductions
        self.device = device if device is not None else next(chunks[0].parameters()).device
        assert initial_value is not None or not any(p.is_meta for c in chunks for p in c.parameters()), \
            "parameters on the meta device need initial_value"
        assert (offload_optimizer == "nvme") == (nvme is not None), (offload_optimizer, nvme)
        assert offload_params != "nvme" or (offload_optimizer == "nvme" and self.policy.shard_params), \
            "the shards on a disk are updated by the states' stream"
        # the optimizer's states (or, on a disk, the buffers that stream them) in host memory
        self.offload_optimizer = offload_optimizer in ("cpu", "nvme")
        self.offload_params = offload_params == "cpu"  # the shards in host memory (nvme: on the disk)
        state_device = torch.device("cpu") if self.offload_optimizer else self.device
        param_device = torch.device("cpu") if offload_params in ("cpu", "nvme") else self.device
        param_disk = partial(NvmeParams, nvme) if offload_params == "nvme" else None
        self.world = Comm(dist.group.WORLD if dist.is_initialized() else None, "world", grid.counter)
        # dense gradients reduce (and shard) over dp x cp, the experts' over edp x cp: a partition of their own (ep > 1)
        experts_apart = grid.ep > 1 and any(reduce_group(p) == EXPERT for c in chunks for p in c.parameters())
        make_update = update if update is not None else partial(make_adamw_for, AdamWSection())

        def make_optim(experts: bool) -> Callable[[BucketLayout, Comm], Update]:
            def make(layout: BucketLayout, comm: Comm) -> Update:
                return make_update(UpdateContext(layout, comm, grid, chunks, experts, self.device, state_device,
                                                 self.grad_dtype, weight_decay, adam_impl, peak_lr, nvme,
                                                 last_step, lambda: self.run_step))
            return make

        def part(name: str, select, comm: Comm, tied: Comm) -> Partition:
            return Partition(name, chunks, select, comm, tied, grid.tp_comm, self.policy, self.dtype,
                             self.grad_dtype, bucket_mb, self.device, param_device, initial_value,
                             reshard_after_forward, overlap_param_gather, max_in_flight,
                             make_optim(name == "experts"), param_disk)

        dense = part("dense", (lambda p: reduce_group(p) == DENSE) if experts_apart else (lambda p: True),
                     grid.grad_comm, grid.embed_comm)
        self.parts = [dense]
        if experts_apart:
            untied = Comm(None, "tied", grid.counter)  # no expert is held by two stages
            try:
                self.parts.append(part("experts", lambda p: reduce_group(p) == EXPERT, grid.expert_grad_comm,
                                       untied))
            except BaseException:  # the dense partition's scratch files go with the failed start
                dense.close()
                raise
        # the dense partition's parts, by the names the rest of the repository reads
        self.layout, self.optim, self.finalize = dense.layout, dense.optim, dense.finalize
        self.gatherer, self.reducer, self.checkpoint = dense.gatherer, dense.reducer, dense.checkpoint
        self.nonfinite_param: Optional[str] = None  # named by a step skipped for a non-finite gradient
        self.host_flags: list[float] = []  # the last step's agreed ``flags``, as read with its one host wait
        self._reduced = False

    @property
    def buckets(self) -> list[Bucket]:
        """Every partition's buckets (each partition numbers its own from 0)."""
        return [b for part in self.parts for b in part.buckets]

    @property
    def step_count(self) -> int:
        return self.optim.step_count

    # ----- a step, in order (megazero.engine.step.train_step) -------------------------------------------------------
    def begin(self, microbatches: int) -> None:
        """Before the schedule: ``microbatches`` backward passes will follow."""
        for part in self.parts:
            part.begin(microbatches)
        self._reduced = False

    def reduce(self) -> None:
        """After the schedule: complete this step's gradient reduction (waits for what backward started)."""
        assert not self._reduced, "reduce() once per step"
        for part in self.parts:  # over dp (experts: edp), tied copies summed first, then the tp sums
            part.reduce()
        self._reduced = True

    def step(self, lr: float, max_norm: float, grad_scale: float = 1.0, loss: Optional[Tensor] = None,
             flags: Optional[Tensor] = None, locate_nonfinite: bool = True) -> tuple[float, bool]:
        """Clip and update after ``reduce``; returns (global grad norm, skipped because of a non-finite value).

        ``grad_scale`` unscales the gradients (1/loss scale under fp16). A non-finite gradient anywhere, or a
        non-finite ``loss`` (this rank's loss sum, if it holds one), skips the update on every rank; with
        ``locate_nonfinite`` ``nonfinite_param`` then names the first parameter (on this rank) with a
        non-finite gradient. ``flags`` are the caller's per-rank values (a stop request, say): reduced with
        MAX over every rank in place, in the step's one world all-reduce, at no extra collective, and read on the
        host with the norm (``host_flags``): no second wait for the device."""
        assert self._reduced, "reduce() before step()"
        self._reduced = False
        self.run_step += 1
        self.nonfinite_param = None
        grads = [part.grads() for part in self.parts]
        sums = [part.optim.sq_norm(g) for part, g in zip(self.parts, grads)]
        bad = torch.isfinite(torch.stack(sums).sum()).logical_not()
        if loss is not None:
            bad = bad | torch.isfinite(loss).logical_not()
        agreed = bad.float().reshape(1) if flags is None else torch.cat([bad.float().reshape(1), flags.float()])
        self.world.all_reduce(agreed, op=dist.ReduceOp.MAX, tag="overflow")
        if flags is not None:
            flags.copy_(agreed[1:])
        for part, sq in zip(self.parts, sums):
            if part.reducer.local:  # local gradients (1-bit Adam): the RMS over ranks of n * g_rank's norm
                part.comm.all_reduce(sq, tag="grad_norm")
                sq.mul_(part.comm.size)
            elif self.policy.shard_optimizer:  # each partition's shards over its own group
                part.comm.all_reduce(sq, tag="grad_norm")
        if len(sums) > 1:  # the experts: each ep rank holds others, so they are summed over ep too
            self.grid.ep_comm.all_reduce(sums[1], tag="grad_norm")
        sumsq = torch.stack(sums).sum()
        self.grid.tp_comm.all_reduce(sumsq, tag="grad_norm")
        self.grid.pp_comm.all_reduce(sumsq, tag="grad_norm")
        # the step's one wait for the device: the agreed flags (the caller's too) and the norm, in one read
        *agreed_host, root = host_values(torch.cat([agreed, sumsq.sqrt().reshape(1)]))
        flag, self.host_flags = agreed_host[0], agreed_host[1:]
        norm = root * grad_scale
        if flag:
            if locate_nonfinite:  # rare path: say where
                found = [part.optim.first_nonfinite(g) for part, g in zip(self.parts, grads)]
                self.nonfinite_param = next((n for n in found if n is not None), None)
            self.zero_grad()
            for part in self.parts:
                part.gatherer.release()  # stage 3: the root stays gathered otherwise, until the next forward
            return norm, True
        coef = min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0
        for part, g in zip(self.parts, grads):
            part.optim.update(g, lr, grad_scale * coef, part.finalize.rewritten())
            if not part.optim.wrote_whole_params():
                part.gatherer.after_step()
        self.zero_grad()
        return norm, False

    def zero_grad(self) -> None:
        """Forget this step's gradients (after any early host copy of them has landed: it reads them)."""
        for part in self.parts:
            part.optim.discard()
            part.reducer.zero_grad()

    # ----- outside a step -----------------------------------------------------------------------------------------
    def gather_root(self) -> None:
        """Stage 3: gather the root bucket(s) for forwards outside a step (evaluation)."""
        for part in self.parts:
            part.gatherer.gather_root()

    def release(self) -> None:
        """Stage 3: free every gathered bucket (after evaluation)."""
        for part in self.parts:
            part.gatherer.release()

    def settle(self) -> None:
        """Complete parameter gathers in flight (before reading the parameters outside a forward)."""
        for part in self.parts:
            part.gatherer.settle()

    def full_parameters(self) -> dict[str, Tensor]:
        self.settle()
        return {n: t for part in self.parts for n, t in part.checkpoint.full_parameters().items()}

    def export_state(self) -> dict[str, dict[str, Tensor]]:
        self.settle()
        return {n: t for part in self.parts for n, t in part.checkpoint.export_state().items()}

    def import_state(self, state: dict[str, dict[str, Tensor]], step: int, run_step: Optional[int] = None) -> None:
        """A checkpoint's states, written at optimizer step ``step`` and train step ``run_step`` (default: the
        same; they differ by the steps skipped for non-finite gradients)."""
        self.settle()
        self.run_step = step if run_step is None else run_step
        for part in self.parts:
            part.checkpoint.import_state(state, step)
            part.optim.states_loaded()

    def rank_state(self, step: int) -> dict[str, Tensor]:
        """What belongs to this rank alone and its place in the layout as of optimizer step ``step`` (1-bit
        Adam's error buffers), by "<partition>/<key>": see ``Update.rank_state``."""
        return {f"{part.name}/{k}": t for part in self.parts for k, t in part.optim.rank_state(step).items()}

    def rebuild_rank_state(self, key: str, step: int) -> bool:
        """``key`` ("<partition>/<key>") of ``rank_state`` is missing from an older checkpoint: whether its
        partition's update rebuilt it from optimizer step ``step``."""
        name, own = key.split("/", 1)
        return any(part.optim.rebuild_rank_state(own, step) for part in self.parts if part.name == name)

    def full_gradients(self) -> dict[str, Tensor]:
        """Stage 0, after ``reduce``: every parameter's reduced gradient, by name (for inspection and tests)."""
        assert not self.policy.shard_optimizer, "only stage 0 keeps whole reduced gradients"
        return {n: part.reducer.grad(b)[off:off + p.numel()].view(p.shape)
                for part in self.parts for b in part.buckets for (n, p), off in zip(b.params, b.offsets)}

    def optimizer_record(self) -> dict[str, float]:
        """The last update's figures for the metrics (``Update.record``: LAMB's trust ratios, Muon's update RMS,
        1-bit Adam's compressed bytes), combined over the partitions and, unless local, over the world: a
        collective, so every rank calls it at the same steps."""
        records = [part.optim.record() for part in self.parts]
        if records[0] is None:
            return {}
        op = records[0].op
        assert op in ("sum", "max", "local") and all(r is not None and r.op == op for r in records), records
        total = over_partitions(records, self.device)
        if op != "local":
            self.world.all_reduce(total, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM,
                                  tag="optimizer_record")
        return records[0].finish(host_values(total))

    # ----- accounting ---------------------------------------------------------------------------------------------
    @property
    def gathered_bytes(self) -> int:
        return sum(part.gatherer.gathered_bytes for part in self.parts)

    @property
    def peak_gathered_bytes(self) -> int:
        return sum(part.gatherer.peak_gathered_bytes for part in self.parts)

    def tensors_by_kind(self) -> dict[str, list[Tensor]]:
        """The tensors this rank keeps across steps, by kind ("params", "grads", "optimizer"), and under "host"
        those of them that live on the host when offloaded (on a CPU run too), for a memory tracker to name."""
        out: dict[str, list[Tensor]] = {"params": [], "grads": [], "optimizer": [], "host": []}
        for part in self.parts:
            for kind, ts in part.tensors_by_kind(self.offload_optimizer, self.offload_params).items():
                out[kind] += ts
        return out

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds persistently, by kind and place (what the dry-run plans)."""
        out = dict.fromkeys(("params", "grads", "optimizer", "cpu", "nvme"), 0)
        for part in self.parts:
            for k, n in part.state_bytes(self.policy.keeps_full_grads, self.device.type != "cpu").items():
                out[k] += n
        return out

    def close(self) -> None:
        """Release what the optimizers hold outside the process's tensors (zero.offload_optimizer=nvme: the
        scratch files, removed; zero.offload_params=nvme: the shards' too)."""
        for part in self.parts:
            part.close()

"""ZeRO data parallelism (Rajbhandari et al., SC'20) composed from its parts.

- ``StagePolicy``: what the stage shards and when it communicates.
- ``BucketLayout``: the flat, dp-padded buckets and the parameter memory.
- ``GradReducer``: backward hooks, microbatch sums, reductions over dp with a bounded number in flight.
- ``GradFinalizer``: the sums beyond dp: tied copies over the embedding group, sequence-parallel over tp.
- ``ParamGatherer``: stage 3's gather/free/prefetch; stages 1-2's overlapped all-gather after the step.
- ``ShardedAdamW``: fp32 masters, moments, the norm and the update, on the device or offloaded; ``ShardedLamb``
  the same states with LAMB's per-layer trust ratio; ``ShardedMuon`` the same states with Muon on the layers'
  matrices, each gathered whole to an owner over the stage's ranks (``parallel.zero.matrix_plan``);
  ``ShardedOnebitAdam`` AdamW's warm-up, then a frozen variance and the momentum averaged 1-bit compressed.
- ``ZeroCheckpoint``: layout-free export and import of every parameter's state.
- ``Partition``: the parts above for the parameters of one reduction group (dense over dp, experts over edp).

Communication per step and rank in elements on the wire, m = 1 microbatch: 2Ψ(dp−1)/dp for stages
0–2 (all-reduce = reduce-scatter + all-gather), and 3Ψ(dp−1)/dp for stage 3 (two gathers and a
reduce-scatter). ``megazero.engine.step.train_step`` drives one step; nothing else needs to know the order.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megazero.parallel.comm import Comm
from megazero.parallel.host import host_values
from megazero.parallel.topology import Grid
from megazero.parallel.zero.declared import DENSE, EXPERT, reduce_group
from megazero.parallel.zero.grads import grad_precision
from megazero.parallel.zero.adamw import ShardedAdamW
from megazero.parallel.zero.lamb import ShardedLamb
from megazero.parallel.zero.layout import Bucket, BucketLayout
from megazero.parallel.zero.matrix_plan import StagePlace
from megazero.parallel.zero.muon import MuonSettings, ShardedMuon, muon_matrices
from megazero.parallel.zero.onebit_adam import ShardedOnebitAdam
from megazero.parallel.zero.partition import Partition
from megazero.parallel.zero.policy import StagePolicy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ZeroOptimizer:
    """The stage's parameters, their gradients' reduction, and AdamW on this rank's share of them."""

    def __init__(self, chunks: list[nn.Module], grid: Grid, stage: int, precision: str, lr: float,
                 weight_decay: float, bucket_mb: float = 25.0, reshard_after_forward: bool = True,
                 offload_optimizer: str = "none", offload_params: str = "none",
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, adam_impl: str = "torch",
                 device: Optional[torch.device] = None,
                 initial_value: Optional[Callable[[nn.Parameter], Tensor]] = None, grad_dtype: str = "auto",
                 overlap_param_gather: bool = True, max_in_flight: int = 2, optimizer: str = "adamw",
                 muon: Optional[MuonSettings] = None, freeze_step: int = 1000):
        """device: where the model computes (default: where its parameters are). Parameters still on the meta
        device (stage 3's lazily built model) are created bucket by bucket from ``initial_value(param)``, so
        the whole stage never exists unsharded. ``lr`` is the caller's; each step passes its own. ``optimizer``:
        adamw | lamb | muon | onebit_adam (``ShardedAdamW``, ``ShardedLamb``, ``ShardedMuon`` with ``muon``'s
        settings, ``ShardedOnebitAdam`` with its warm-up ending at ``freeze_step``)."""
        del lr
        self.grid = grid
        self.policy = StagePolicy.of(stage)
        self.dtype = DTYPES[precision]
        self.grad_dtype = DTYPES[grad_precision(precision, grad_dtype)]  # microbatch sums and dp reductions
        self.device = device if device is not None else next(chunks[0].parameters()).device
        assert initial_value is not None or not any(p.is_meta for c in chunks for p in c.parameters()), \
            "parameters on the meta device need initial_value"
        self.offload_optimizer, self.offload_params = offload_optimizer == "cpu", offload_params == "cpu"
        state_device = torch.device("cpu") if offload_optimizer == "cpu" else self.device
        param_device = torch.device("cpu") if offload_params == "cpu" else self.device
        self.world = Comm(dist.group.WORLD if dist.is_initialized() else None, "world", grid.counter)
        # dense gradients reduce (and shard) over dp x cp, the experts' over edp x cp: a partition of their own (ep > 1)
        experts_apart = grid.ep > 1 and any(reduce_group(p) == EXPERT for c in chunks for p in c.parameters())

        matrices = muon_matrices(chunks) if optimizer == "muon" else {}
        stage_comm = grid.stage_comm() if optimizer == "muon" else None

        def make_optim(experts: bool):
            def make(layout: BucketLayout, comm: Comm) -> ShardedAdamW:
                if optimizer == "lamb":
                    return ShardedLamb(layout, self.device, state_device, weight_decay, betas, eps, self.grad_dtype,
                                       comm if self.policy.shard_optimizer else None, grid.tp_comm)
                if optimizer == "muon":
                    assert state_device == self.device, "Muon's states stay on the device"
                    place = StagePlace(grid.tp, grid.cp, grid.ep, experts, grid.dp * grid.cp * grid.tp)
                    return ShardedMuon(layout, self.device, weight_decay, betas, eps, self.grad_dtype, matrices,
                                       stage_comm, place, muon or MuonSettings())
                if optimizer == "onebit_adam":
                    assert state_device == self.device, "1-bit Adam's states stay on the device"
                    return ShardedOnebitAdam(layout, self.device, weight_decay, betas, eps, self.grad_dtype, comm,
                                             grid.tp_comm.rank, grid.tp_comm.size, freeze_step)
                assert optimizer == "adamw", optimizer
                impl = adam_impl if state_device == self.device else "fused"
                return ShardedAdamW(layout, self.device, state_device, impl, weight_decay, betas, eps,
                                    self.grad_dtype)
            return make

        def part(name: str, select, comm: Comm, tied: Comm) -> Partition:
            return Partition(name, chunks, select, comm, tied, grid.tp_comm, self.policy, self.dtype,
                             self.grad_dtype, bucket_mb, self.device, param_device, initial_value,
                             reshard_after_forward, overlap_param_gather, max_in_flight,
                             make_optim(name == "experts"))

        dense = part("dense", (lambda p: reduce_group(p) == DENSE) if experts_apart else (lambda p: True),
                     grid.grad_comm, grid.embed_comm)
        self.parts = [dense]
        if experts_apart:
            untied = Comm(None, "tied", grid.counter)  # no expert is held by two stages
            self.parts.append(part("experts", lambda p: reduce_group(p) == EXPERT, grid.expert_grad_comm, untied))
        # the dense partition's parts, by the names the rest of the repository reads
        self.layout, self.optim, self.finalize = dense.layout, dense.optim, dense.finalize
        self.gatherer, self.reducer, self.checkpoint = dense.gatherer, dense.reducer, dense.checkpoint
        self.nonfinite_param: Optional[str] = None  # named by a step skipped for a non-finite gradient
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
        MAX over every rank in place, in the step's one world all-reduce, at no extra collective."""
        assert self._reduced, "reduce() before step()"
        self._reduced = False
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
        flag, root = host_values(torch.stack([agreed[0], sumsq.sqrt()]))  # the step's one wait for the device
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

    def import_state(self, state: dict[str, dict[str, Tensor]], step: int) -> None:
        self.settle()
        for part in self.parts:
            part.checkpoint.import_state(state, step)
            part.optim.states_loaded()

    def rank_state(self, step: int) -> dict[str, Tensor]:
        """What belongs to this rank alone and its place in the layout as of optimizer step ``step`` (1-bit
        Adam's error buffers), by "<partition>/<key>": see ``ShardedOnebitAdam.rank_state``."""
        return {f"{part.name}/{k}": t for part in self.parts
                for k, t in getattr(part.optim, "rank_state", lambda step: {})(step).items()}

    def full_gradients(self) -> dict[str, Tensor]:
        """Stage 0, after ``reduce``: every parameter's reduced gradient, by name (for inspection and tests)."""
        assert not self.policy.shard_optimizer, "only stage 0 keeps whole reduced gradients"
        return {n: part.reducer.grad(b)[off:off + p.numel()].view(p.shape)
                for part in self.parts for b in part.buckets for (n, p), off in zip(b.params, b.offsets)}

    def optimizer_record(self) -> dict[str, float]:
        """The last update's figures for the metrics (collective over the world: every rank calls it at the same
        steps): LAMB's smallest and largest trust ratio over every layer of the model; Muon's RMS of its matrix
        updates (before the learning rate: ~0.2 by construction, Liu et al. 2025), over every matrix once."""
        if any(isinstance(part.optim, ShardedOnebitAdam) for part in self.parts):
            return {"optim/compressed_bytes": sum(part.optim.sent for part in self.parts)}
        if any(isinstance(part.optim, ShardedMuon) for part in self.parts):
            sums = [r for r in (part.optim.update_rms() for part in self.parts) if r is not None]
            total = torch.stack(sums).sum(0).to(self.device) if sums else \
                torch.zeros(2, dtype=torch.float64, device=self.device)
            self.world.all_reduce(total, tag="optimizer_record")
            sq, n = host_values(total)
            return {"optim/update_rms": math.sqrt(sq / n) if n else 0.0}
        ranges = [r for r in (getattr(part.optim, "trust_range", lambda: None)() for part in self.parts)
                  if r is not None]
        if not any(isinstance(part.optim, ShardedLamb) for part in self.parts):
            return {}
        both = torch.stack([torch.stack([-r[0], r[1]]) for r in ranges]).amax(0) if ranges else \
            torch.full((2,), -float("inf"), dtype=torch.float64, device=self.device)
        both = both.to(device=self.device, dtype=torch.float64)
        self.world.all_reduce(both, op=dist.ReduceOp.MAX, tag="optimizer_record")
        low, high = host_values(both)
        return {"optim/trust_min": -low, "optim/trust_max": high}

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
            o, buckets, r = part.optim, part.buckets, part.reducer
            params = [b.full for b in buckets] + [b.shard_param for b in buckets if b.shard_param is not None]
            grads = [t for t in r.full + r.shard if t is not None]
            staging = [t for t in o.host_grad if t is not None]
            states = [t for kind in (o.exp_avg, o.exp_avg_sq, o.decay_mask) for t in kind if t is not None]
            states += [m for m, own in zip(o.master, o.master_is_param) if not own]
            states += getattr(o, "own_tensors", lambda: [])()
            host = (states + staging if self.offload_optimizer else []) \
                + ([b.shard_param for b in buckets if b.shard_param is not None] if self.offload_params else [])
            for kind, ts in (("params", params), ("grads", grads + staging), ("optimizer", states), ("host", host)):
                out[kind] += ts
        return out

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds persistently, by kind and place (what the dry-run plans)."""
        dev = {"params": 0, "grads": 0, "optimizer": 0}
        cpu = 0
        on_gpu = self.device.type != "cpu"
        for part in self.parts:
            for b in part.buckets:
                if b.shard_param is not None:
                    n = b.shard_param.numel() * b.shard_param.element_size()
                    if part.layout.param_device.type == "cpu" and on_gpu:
                        cpu += n
                    else:
                        dev["params"] += n
                else:
                    dev["params"] += b.full.numel() * b.full.element_size()
                r = part.reducer
                grads = r.full[b.index] if self.policy.keeps_full_grads else r.shard[b.index]
                dev["grads"] += grads.numel() * grads.element_size()
            opt = part.optim.state_bytes()
            if part.optim.offloaded():
                cpu += opt + part.optim.staging_bytes()  # and the gradients' pinned landing buffers
            else:
                dev["optimizer"] += opt
        return {**dev, "cpu": cpu}

"""ZeRO data parallelism (Rajbhandari et al., SC'20) composed from its parts.

- ``StagePolicy``: what the stage shards and when it communicates.
- ``BucketLayout``: the flat, dp-padded buckets and the parameter memory.
- ``GradReducer``: backward hooks, microbatch sums, reductions over dp with a bounded number in flight.
- ``GradFinalizer``: the sums beyond dp: tied copies over the embedding group, sequence-parallel over tp.
- ``ParamGatherer``: stage 3's gather/free/prefetch; stages 1-2's overlapped all-gather after the step.
- ``ShardedAdamW``: fp32 masters, moments, the norm and the update, on the device or offloaded.
- ``ZeroCheckpoint``: layout-free export and import of every parameter's state.

Communication per step and rank in elements on the wire, m = 1 microbatch: 2Ψ(dp−1)/dp for stages
0–2 (all-reduce = reduce-scatter + all-gather), and 3Ψ(dp−1)/dp for stage 3 (two gathers and a
reduce-scatter). ``megazero.engine.step.train_step`` drives one step; nothing else needs to know the order.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallel.comm import Comm
from parallel.host import host_values
from parallel.topology import Grid
from parallel.zero.adamw import ShardedAdamW
from parallel.zero.checkpoint import ZeroCheckpoint
from parallel.zero.finalize import GradFinalizer
from parallel.zero.gather import ParamGatherer
from parallel.zero.grads import GradReducer, grad_precision
from parallel.zero.layout import Bucket, BucketLayout
from parallel.zero.policy import StagePolicy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ZeroOptimizer:
    """The stage's parameters, their gradients' reduction, and AdamW on this rank's share of them."""

    def __init__(self, chunks: list[nn.Module], grid: Grid, stage: int, precision: str, lr: float,
                 weight_decay: float, bucket_mb: float = 25.0, reshard_after_forward: bool = True,
                 offload_optimizer: str = "none", offload_params: str = "none",
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, adam_impl: str = "torch",
                 device: Optional[torch.device] = None,
                 initial_value: Optional[Callable[[nn.Parameter], Tensor]] = None, grad_dtype: str = "auto",
                 overlap_param_gather: bool = True, max_in_flight: int = 2):
        """device: where the model computes (default: where its parameters are). Parameters still on the meta
        device (stage 3's lazily built model) are created bucket by bucket from ``initial_value(param)``, so
        the whole stage never exists unsharded. ``lr`` is the caller's; each step passes its own."""
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
        self.layout = BucketLayout(chunks, self.policy, grid.dp_comm.size, grid.dp_comm.rank, self.dtype,
                                   self.grad_dtype, bucket_mb, self.device, param_device)
        # the Triton kernel runs where the states are; offloaded states step with the fused CPU kernel
        impl = adam_impl if state_device == self.device else "fused"
        self.optim = ShardedAdamW(self.layout, self.device, state_device, impl, weight_decay, betas, eps,
                                  self.grad_dtype)
        self.finalize = GradFinalizer(grid.embed_comm, grid.tp_comm, self.device)

        def add(b: Bucket, initial: Tensor) -> None:
            decay, count, sp = self.layout.mask_runs(b, grid.tp_comm.rank)
            self.optim.add_bucket(b, initial, decay, count)
            self.finalize.add_bucket(b, sp)

        self.layout.materialise(initial_value, add)
        self.gatherer = ParamGatherer(chunks, self.layout, self.policy, grid.dp_comm, self.device,
                                      reshard_after_forward, overlap_param_gather)
        self.reducer = GradReducer(self.layout, self.policy, grid.dp_comm, self.grad_dtype, self.device,
                                   max_in_flight, on_backward_done=self.gatherer.backward_done,
                                   on_final=self.optim.grad_ready, before_deferred=self.finalize.sum_tied)
        self.checkpoint = ZeroCheckpoint(self.layout, self.policy, self.optim, grid.dp_comm, self.device,
                                         host_ok=grid.tp_comm.size == 1)
        self.nonfinite_param: Optional[str] = None  # named by a step skipped for a non-finite gradient
        self._reduced = False

    @property
    def buckets(self) -> list[Bucket]:
        return self.layout.buckets

    @property
    def step_count(self) -> int:
        return self.optim.step_count

    # ----- a step, in order (megazero.engine.step.train_step) -------------------------------------------------------
    def begin(self, microbatches: int) -> None:
        """Before the schedule: ``microbatches`` backward passes will follow."""
        self.reducer.begin(microbatches)
        self.gatherer.gather_root()
        self._reduced = False

    def reduce(self) -> None:
        """After the schedule: complete this step's gradient reduction (waits for what backward started)."""
        assert not self._reduced, "reduce() once per step"
        self.gatherer.settle()  # stage 3's unused prefetches, before the update writes what they read
        self.reducer.finish()  # over dp, tied copies summed first (``before_deferred``)
        self.finalize.sum_sequence_parallel([self.reducer.grad(b) for b in self.buckets])
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
        grads = [self.reducer.grad(b) for b in self.buckets]
        sumsq = self.optim.sq_norm(grads)
        bad = torch.isfinite(sumsq).logical_not()
        if loss is not None:
            bad = bad | torch.isfinite(loss).logical_not()
        agreed = bad.float().reshape(1) if flags is None else torch.cat([bad.float().reshape(1), flags.float()])
        self.world.all_reduce(agreed, op=dist.ReduceOp.MAX, tag="overflow")
        if flags is not None:
            flags.copy_(agreed[1:])
        if self.policy.shard_optimizer:
            self.grid.dp_comm.all_reduce(sumsq, tag="grad_norm")
        self.grid.tp_comm.all_reduce(sumsq, tag="grad_norm")
        self.grid.pp_comm.all_reduce(sumsq, tag="grad_norm")
        flag, root = host_values(torch.stack([agreed[0], sumsq.sqrt()]))  # the step's one wait for the device
        norm = root * grad_scale
        if flag:
            if locate_nonfinite:  # rare path: say where
                self.nonfinite_param = self.optim.first_nonfinite(grads)
            self.zero_grad()
            self.gatherer.release()  # stage 3: the root stays gathered otherwise, until the next forward
            return norm, True
        coef = min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0
        self.optim.update(grads, lr, grad_scale * coef, self.finalize.rewritten())
        self.gatherer.after_step()
        self.zero_grad()
        return norm, False

    def zero_grad(self) -> None:
        """Forget this step's gradients (after any early host copy of them has landed: it reads them)."""
        self.optim.discard()
        self.reducer.zero_grad()

    # ----- outside a step -----------------------------------------------------------------------------------------
    def gather_root(self) -> None:
        """Stage 3: gather the root bucket(s) for forwards outside a step (evaluation)."""
        self.gatherer.gather_root()

    def release(self) -> None:
        """Stage 3: free every gathered bucket (after evaluation)."""
        self.gatherer.release()

    def settle(self) -> None:
        """Complete parameter gathers in flight (before reading the parameters outside a forward)."""
        self.gatherer.settle()

    def full_parameters(self) -> dict[str, Tensor]:
        self.settle()
        return self.checkpoint.full_parameters()

    def export_state(self) -> dict[str, dict[str, Tensor]]:
        self.settle()
        return self.checkpoint.export_state()

    def import_state(self, state: dict[str, dict[str, Tensor]], step: int) -> None:
        self.settle()
        self.checkpoint.import_state(state, step)

    def full_gradients(self) -> dict[str, Tensor]:
        """Stage 0, after ``reduce``: every parameter's reduced gradient, by name (for inspection and tests)."""
        assert not self.policy.shard_optimizer, "only stage 0 keeps whole reduced gradients"
        return {n: self.reducer.grad(b)[off:off + p.numel()].view(p.shape)
                for b in self.buckets for (n, p), off in zip(b.params, b.offsets)}

    # ----- accounting ---------------------------------------------------------------------------------------------
    @property
    def gathered_bytes(self) -> int:
        return self.gatherer.gathered_bytes

    @property
    def peak_gathered_bytes(self) -> int:
        return self.gatherer.peak_gathered_bytes

    def tensors_by_kind(self) -> dict[str, list[Tensor]]:
        """The tensors this rank keeps across steps, by kind ("params", "grads", "optimizer"), and under "host"
        those of them that live on the host when offloaded (on a CPU run too), for a memory tracker to name."""
        o = self.optim
        params = [b.full for b in self.buckets] + [b.shard_param for b in self.buckets if b.shard_param is not None]
        grads = [t for t in self.reducer.full + self.reducer.shard if t is not None]
        staging = [t for t in o.host_grad if t is not None]
        states = [t for kind in (o.exp_avg, o.exp_avg_sq, o.decay_mask) for t in kind if t is not None]
        states += [m for m, own in zip(o.master, o.master_is_param) if not own]
        host = (states + staging if self.offload_optimizer else []) \
            + ([b.shard_param for b in self.buckets if b.shard_param is not None] if self.offload_params else [])
        return {"params": params, "grads": grads + staging, "optimizer": states, "host": host}

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds persistently, by kind and place (what the dry-run plans)."""
        dev = {"params": 0, "grads": 0, "optimizer": 0}
        cpu = 0
        on_gpu = self.device.type != "cpu"
        for b in self.buckets:
            if b.shard_param is not None:
                n = b.shard_param.numel() * b.shard_param.element_size()
                if self.layout.param_device.type == "cpu" and on_gpu:
                    cpu += n
                else:
                    dev["params"] += n
            else:
                dev["params"] += b.full.numel() * b.full.element_size()
            grads = self.reducer.full[b.index] if self.policy.keeps_full_grads else self.reducer.shard[b.index]
            dev["grads"] += grads.numel() * grads.element_size()
        opt = self.optim.state_bytes()
        if self.optim.offloaded():
            cpu += opt + self.optim.staging_bytes()  # and the gradients' pinned landing buffers
        else:
            dev["optimizer"] += opt
        return {**dev, "cpu": cpu}

"""AdamW on this rank's share of the flat buffers: fp32 masters and moments, on the device or offloaded.

The states cover the optimizer's range of every bucket (``BucketLayout.range``): the own dp slice when the
optimizer is sharded, the whole bucket otherwise. Offloaded (``zero.offload_optimizer=cpu``), they live
in (pinned) host memory and the update runs there with torch's fused CPU AdamW over views of the flat
buffers (``kernels.adam_cpu``); each bucket's reduced gradient is copied to the host on a side stream as
soon as it is final, overlapping the rest of backward (ZeRO-Offload, Ren et al. 2021, section 4.1).
Knows nothing of hooks or communication: it gets reduced gradients and returns norms and updates.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

from megazero.kernels.adam import adamw
from megazero.kernels.adam_cpu import Run
from megazero.parallel.zero.layout import Bucket, BucketLayout

if TYPE_CHECKING:
    from megazero.parallel.zero.registry import AdamWSection
    from megazero.parallel.zero.update import Record, UpdateContext

NORM_PIECE = 2 ** 16  # elements per CPU norm piece (sq_norm)


def make_adamw(section: "AdamWSection", ctx: "UpdateContext") -> "ShardedAdamW":
    """AdamW over one partition with its states in memory (offloaded ones step with the fused CPU kernel); the
    registry's factory is ``parallel.zero.nvme_adamw.make_adamw_for``, which also streams them from a disk."""
    impl = ctx.adam_impl if ctx.state_device == ctx.device else "fused"
    return ShardedAdamW(ctx.layout, ctx.device, ctx.state_device, impl, ctx.weight_decay,
                        (section.beta1, section.beta2), section.eps, ctx.grad_dtype)


def _shapes_only(tensors: list[Tensor]) -> bool:
    """Tensors without values (fake or meta): only their shapes and bytes matter."""
    return any(isinstance(t, FakeTensor) or t.is_meta for t in tensors)


class ShardedAdamW:
    def __init__(self, layout: BucketLayout, device: torch.device, state_device: torch.device, impl: str,
                 weight_decay: float, betas: tuple[float, float], eps: float, grad_dtype: torch.dtype):
        self.layout, self.device, self.state_device, self.grad_dtype = layout, device, state_device, grad_dtype
        self.impl, self.weight_decay, self.betas, self.eps = impl, weight_decay, betas, eps
        self.step_count = 0
        n = len(layout.buckets)
        self.master: list[Optional[Tensor]] = [None] * n
        self.master_is_param = [False] * n  # fp32 parameters on the states' device are their own masters
        self.exp_avg: list[Optional[Tensor]] = [None] * n
        self.exp_avg_sq: list[Optional[Tensor]] = [None] * n
        self.decay_mask: list[Optional[Tensor]] = [None] * n
        self.runs: list[list] = [[] for _ in range(n)]
        self.counted: list[list] = [[] for _ in range(n)]  # runs of the range: do they count toward the norm
        self.norm_weights: dict[str, Tensor] = {}  # per set of runs: 1 where a run counts, 0 elsewhere
        self.host_grad: list[Optional[Tensor]] = [None] * n  # offloaded: pinned landing buffers
        self.copied = [False] * n
        self.copy_stream = None
        # None, or a list the host copies append (bytes, CUDA event recorded at the copy's end) to: set it to []
        # to time their overlap with the backward (bench/offload_overlap.py); the caller empties it
        self.copy_events: Optional[list] = None
        self.pinned = device.type == "cuda" and state_device.type == "cpu"
        if self.pinned:
            self.copy_stream = torch.cuda.Stream(device)

    def offloaded(self) -> bool:
        return self.state_device != self.device

    # ----- states -------------------------------------------------------------------------------------------
    def add_bucket(self, b: Bucket, initial: Tensor, decay: list[Run], count: list[Run]) -> None:
        """The states of one bucket's range, from its fp32 initial values and its runs of (weight decay
        applies) and (counts toward the norm) (``BucketLayout.mask_runs``). Where the parameters are fp32 on
        the state's device, the parameter slice itself is the master copy (no second fp32 copy)."""
        i = b.index
        target = self.target(b)
        if target.dtype == torch.float32 and self.state_device == self.device == target.device:
            self.master[i], self.master_is_param[i] = target, True
        else:
            self.master[i] = initial.to(self.state_device)
            if self.pinned:
                self.master[i] = self.master[i].pin_memory()
        # page-locked when offloaded from a GPU: asynchronous copies both ways
        m = torch.zeros(initial.numel(), dtype=torch.float32, device=self.state_device, pin_memory=self.pinned)
        v = torch.zeros(initial.numel(), dtype=torch.float32, device=self.state_device, pin_memory=self.pinned)
        if self.pinned:  # the reduced gradient's landing buffer, in its own dtype (converted in bounded chunks)
            self.host_grad[i] = torch.empty(initial.numel(), dtype=self.grad_dtype, pin_memory=True)
        self.exp_avg[i], self.exp_avg_sq[i] = m, v
        if self.impl != "fused":  # the fused kernel steps run by run; the others read a mask (1 B per element)
            mask = torch.zeros(initial.numel(), dtype=torch.bool, device=self.state_device)
            for a, z, on in decay:
                if on:
                    mask[a:z] = True
            self.decay_mask[i] = mask
        self.runs[i] = decay
        self.counted[i] = count  # (start, end, counts toward the norm)

    def target(self, b: Bucket) -> Tensor:
        """Where the updated parameters go: the range of the whole-parameter buffer, or the persistent shard."""
        lo, hi = self.layout.range(b)
        return b.shard_param if b.shard_param is not None else b.full[lo:hi]

    # ----- gradients ----------------------------------------------------------------------------------------
    def grad_ready(self, b: Bucket, grad: Tensor) -> None:
        """A bucket's reduced gradient is final: start its copy to the host (offloaded on a GPU only)."""
        if not self.pinned:
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            self.host_grad[b.index].copy_(grad, non_blocking=True)
        grad.record_stream(self.copy_stream)
        self.copied[b.index] = True
        if self.copy_events is not None:
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.copy_stream)
            self.copy_events.append((grad.numel() * grad.element_size(), done))

    def discard(self) -> None:
        """A skipped step: wait for the early copies (their source is about to be zeroed) and forget them."""
        if self.pinned:
            self.copy_stream.synchronize()
        self.copied = [False] * len(self.copied)

    # ----- what the reducer is asked for ------------------------------------------------------------------------
    def reads_reduced_gradients(self) -> bool:
        """The next step reads gradients reduced over dp (else the reducer leaves them local: 1-bit Adam)."""
        return True

    def may_read_local_gradients(self) -> bool:
        """Some step may read local gradients (whole buckets): the finalizer then keeps whole-bucket runs."""
        return False

    def wrote_whole_params(self) -> bool:
        """Every rank writes its range; stages 1-2 then gather them."""
        return False

    def states_loaded(self) -> None:
        """A checkpoint has just written the states (an optimizer with derived state rebuilds it here)."""

    def rank_state(self, step: int) -> dict[str, Tensor]:
        """Nothing of AdamW's belongs to one rank alone: every state is a share of a logical tensor."""
        return {}

    def rebuild_rank_state(self, key: str, step: int) -> bool:
        """What a rank keeps alone (error feedback, momentum) cannot be made up: a missing key refuses the resume."""
        return False

    def record(self) -> Optional["Record"]:
        """AdamW reports no figures of its own."""
        return None

    def sq_norm(self, grads: list[Tensor]) -> Tensor:
        """Sum of squares of the gradients that count toward the global norm (each parameter once)."""
        return self.counted_sq_norm(grads, [self.counted[b.index] for b in self.layout.buckets], "range")

    def counted_sq_norm(self, grads: list[Tensor], counted: list[list[Run]], key: str) -> Tensor:
        """Sum of squares of ``grads`` over the runs of ``counted`` (per bucket, (start, end, counts)) that count;
        ``key`` names the set of runs, whose weights are built once.

        On the CPU a run is cut into pieces of at most NORM_PIECE elements: torch's CPU norm accumulates in
        order in float32, off by ~1e-5 relative over 10^5 elements and ~3e-4 over 10^7, so a norm would depend
        on how the buckets are cut (the layout); per piece it is off by ~2e-7, and the pieces add in float64.
        Fake tensors (``--simulate``) take one norm per run: thousands of pieces would be thousands of fake ops
        (seconds a step at 10^9 elements) for the same shapes; the weights and the stacked norms keep the
        pieces' sizes, so only the norm's own transient scalars differ (4 bytes a piece)."""
        piece = NORM_PIECE if self.device.type == "cpu" else None
        runs = [(g, lo, min(lo + piece, z) if piece else z)
                for g, bucket_runs in zip(grads, counted) for a, z, _ in bucket_runs
                for lo in (range(a, z, piece) if piece else (a,))]
        if not runs:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        if key not in self.norm_weights:
            flags = [float(c) for bucket_runs in counted for a, z, c in bucket_runs
                     for _ in (range(a, z, piece) if piece else (a,))]
            self.norm_weights[key] = torch.tensor(flags, device=self.device, dtype=torch.float64)
        # one fused, multi-threaded pass over every run, with no full-size temporaries; the runs that do not
        # count (tp-replicated copies off tp rank 0, the tied copy) are weighted 0, so a nan or inf there still
        # makes the norm non-finite and skips the step
        if _shapes_only(grads):  # fake tensors: no sums to keep in order; one norm per run, the pieces' shapes
            whole = [g[a:z] for g, bucket_runs in zip(grads, counted) for a, z, _ in bucket_runs]
            norms = torch.stack(torch._foreach_norm(whole, 2, dtype=torch.float32)).new_empty(len(runs))
        else:
            norms = torch.stack(torch._foreach_norm([g[a:z] for g, a, z in runs], 2, dtype=torch.float32))
        return (norms.double().square() * self.norm_weights[key]).sum().float()

    def first_nonfinite(self, grads: list[Tensor]) -> Optional[str]:
        """The first parameter, in bucket order, with a non-finite gradient element in this rank's range."""
        for b, g in zip(self.layout.buckets, grads):
            bad = torch.isfinite(g).logical_not().nonzero()
            if bad.numel():
                return self.layout.name_at(b, self.layout.range(b)[0] + int(bad[0, 0]))
        return None

    # ----- the update -----------------------------------------------------------------------------------------
    def update(self, grads: list[Tensor], lr: float, grad_scale: float, resend: set[int]) -> None:
        """One AdamW step of every bucket's range; ``grad_scale`` folds loss-scale unscaling and clipping.
        ``resend``: buckets whose gradients changed after their early host copy (the sequence-parallel sum)."""
        self.step_count += 1
        b1, b2 = self.betas
        grads = self.state_grads(grads, resend)
        for b, grad in zip(self.layout.buckets, grads):
            i = b.index
            target = self.target(b)
            same = self.master_is_param[i]
            adamw(self.impl, self.master[i], grad, self.exp_avg[i], self.exp_avg_sq[i], lr=lr, beta1=b1, beta2=b2,
                  eps=self.eps, weight_decay=self.weight_decay, step=self.step_count, decay_mask=self.decay_mask[i],
                  runs=self.runs[i], grad_scale=grad_scale, model_copy=None if same else target)

    def state_grads(self, grads: list[Tensor], resend: set[int]) -> list[Tensor]:
        """The reduced gradients where the states are: the device's own, or (offloaded) their host copies."""
        if self.pinned:  # every early copy is in; the late ones go at once, then one wait
            for b, g in zip(self.layout.buckets, grads):
                if not self.copied[b.index] or b.index in resend:
                    self.grad_ready(b, g)
            self.copy_stream.synchronize()
            self.copied = [False] * len(self.copied)
            return [self.host_grad[b.index] for b in self.layout.buckets]
        if self.offloaded():
            return [g.to(self.state_device) for g in grads]
        return grads

    def bucket_states(self, i: int) -> dict[str, Optional[Tensor]]:
        """Bucket i's master and moments over this rank's range, as a checkpoint reads them: the live tensors."""
        return {"master": self.master[i], "exp_avg": self.exp_avg[i], "exp_avg_sq": self.exp_avg_sq[i]}

    def load_bucket_states(self, i: int, states: dict[str, Tensor]) -> None:
        """A checkpoint's states of bucket i into the live tensors (the master unless it is the parameter)."""
        if not self.master_is_param[i]:
            self.master[i].copy_(states["master"])
        self.exp_avg[i].copy_(states["exp_avg"])
        self.exp_avg_sq[i].copy_(states["exp_avg_sq"])

    def disk_bytes(self) -> int:
        """Bytes of the states on a local disk: none, they are in memory."""
        return 0

    def close(self) -> None:
        """Nothing to release: the states are tensors."""

    def staging_bytes(self) -> int:
        """Bytes of the pinned host buffers the offloaded gradients land in."""
        return sum(t.numel() * t.element_size() for t in self.host_grad if t is not None)

    def staging_tensors(self) -> list[Tensor]:
        return [t for t in self.host_grad if t is not None]

    def state_tensors(self) -> list[Tensor]:
        """Moments, decay masks and the masters that are not the parameters themselves."""
        states = [t for kind in (self.exp_avg, self.exp_avg_sq, self.decay_mask) for t in kind if t is not None]
        return states + [m for m, own in zip(self.master, self.master_is_param) if not own]

    def state_bytes(self) -> int:
        """Bytes of the optimizer's own states (masters that are not the parameters themselves, moments)."""
        total = 0
        for b in self.layout.buckets:
            i = b.index
            total += (self.exp_avg[i].numel() + self.exp_avg_sq[i].numel()) * 4
            if not self.master_is_param[i]:
                total += self.master[i].numel() * 4
        return total

"""ZeRO data parallelism (Rajbhandari et al., SC'20) over flat, bucketed buffers.

Layout: this rank's parameters live in one contiguous buffer per step of the
backward order, cut into buckets of ``zero.bucket_mb`` (stage 3: one bucket
per transformer layer, plus a root bucket for embeddings and final norm).
Every bucket is padded to a multiple of dp, so dp rank r owns the same
contiguous slice [r·n/dp, (r+1)·n/dp) of every bucket; parameters are views
into the buckets.

- stage 0: gradients all-reduced bucket by bucket from backward hooks on the
  last microbatch, overlapping the rest of backward; every rank steps all.
- stage 1: fp32 master weights and Adam moments only for the own slice;
  gradients reduce-scattered into it on the last microbatch; updated
  parameters all-gathered after the step.
- stage 2: as 1, but every microbatch's bucket gradient is reduce-scattered
  as soon as it is complete and then freed: a rank keeps its slice only.
- stage 3: parameters partitioned too (``parallel.zero_params``): a layer's
  bucket is all-gathered before its forward (the next one prefetched), freed
  after it, gathered again for its backward.

Communication per step and rank in elements on the wire, m = 1 microbatch:
2Ψ(dp−1)/dp for stages 0–2 (all-reduce = reduce-scatter + all-gather), and
3Ψ(dp−1)/dp for stage 3 (two gathers and a reduce-scatter).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from kernels.adam import adamw
from parallel.comm import Comm
from parallel.loss_scale import LossScaler
from parallel.topology import Grid
from parallel.zero_checkpoint import ZeroCheckpointing
from parallel.zero_grads import GradientReduction, grad_precision
from parallel.zero_params import Bucket, LayerGathering

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ZeroOptimizer(GradientReduction, LayerGathering, ZeroCheckpointing):
    """The stage's parameters, their gradients' reduction, and AdamW on this rank's share of them."""

    def __init__(self, chunks: list[nn.Module], grid: Grid, stage: int, precision: str, lr: float,
                 weight_decay: float, bucket_mb: float = 25.0, reshard_after_forward: bool = True,
                 offload_optimizer: str = "none", offload_params: str = "none",
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, adam_impl: str = "torch",
                 device: Optional[torch.device] = None,
                 initial_value: Optional[Callable[[nn.Parameter], Tensor]] = None, grad_dtype: str = "auto"):
        """device: where the model computes (default: where its parameters are). Parameters still on the meta
        device (stage 3's lazily built model) are created bucket by bucket from ``initial_value(param)``, so
        the whole stage never exists unsharded."""
        assert stage in (0, 1, 2, 3), stage
        self.grid, self.stage, self.lr, self.weight_decay = grid, stage, lr, weight_decay
        self.betas, self.eps = betas, eps
        self.dtype = DTYPES[precision]
        self.grad_dtype = DTYPES[grad_precision(precision, grad_dtype)]  # microbatch sums and dp reductions
        self.dp = grid.dp_comm.size
        self.dp_rank = grid.dp_comm.rank
        self.reshard_after_forward = reshard_after_forward
        self.scaler = LossScaler(enabled=precision == "fp16")
        self.step_count = 0
        self.nonfinite_param: Optional[str] = None  # set by a step skipped outside fp16 (see step)
        self.microbatches = 1
        self.device = device if device is not None else next(chunks[0].parameters()).device
        self.initial_value = initial_value
        assert initial_value is not None or not any(p.is_meta for c in chunks for p in c.parameters()), \
            "parameters on the meta device need initial_value"
        self.state_device = torch.device("cpu") if offload_optimizer == "cpu" else self.device
        # the fused kernel runs where the optimizer states are; offloaded states step with torch on the CPU
        self.adam_impl = adam_impl if self.state_device == self.device else "torch"
        self.param_device = torch.device("cpu") if offload_params == "cpu" else self.device
        self.gathered_bytes = 0
        self.peak_gathered_bytes = 0
        self.world = Comm(dist.group.WORLD if dist.is_initialized() else None, "world", grid.counter)
        self.tied_embedding = any(c.shares_embedding_across_stages for c in chunks)
        frozen = [n for c in chunks for n, p in c.named_parameters() if not p.requires_grad]
        if frozen:  # its bucket would wait forever for a gradient (and never be reduced)
            raise ValueError(f"ZeroOptimizer trains every parameter it is given; frozen: {', '.join(frozen)}")
        self.buckets = self._make_buckets(chunks, bucket_mb)
        self.owner = self._checkpoint_owners()
        self._materialise()
        self.peak_gathered_bytes = self.gathered_bytes  # training's peak, from here (creation is one bucket)
        if stage == 3:
            self._install_unit_hooks()
        for b in self.buckets:
            for _, p in b.params:
                p.register_post_accumulate_grad_hook(self._grad_hook(b))

    # ----- layout -----------------------------------------------------------------------------
    def _make_buckets(self, chunks: list[nn.Module], bucket_mb: float) -> list[Bucket]:
        """Backward order (last registered first), cut by size or, under stage 3, by layer."""
        groups: list[tuple[list, Optional[nn.Module], bool]] = []
        if self.stage == 3:
            for chunk in reversed(chunks):
                for _, layer in reversed(list(chunk.layers.items())):
                    groups.append(([(n, p) for n, p in _named(chunk, layer)], layer, False))
                root = [(n, p) for n, p in chunk.named_parameters() if not n.startswith("layers.")]
                if root:
                    groups.append((root[::-1], None, True))
        else:
            named = [(n, p) for chunk in chunks for n, p in chunk.named_parameters()][::-1]
            tied = [(n, p) for n, p in named if n == "embed.tokens.weight"
                    and any(c.shares_embedding_across_stages for c in chunks)]
            rest = [(n, p) for n, p in named if all(p is not q for _, q in tied)]
            limit = max(1, int(bucket_mb * 2 ** 20 / torch.tensor([], dtype=self.dtype).element_size()))
            current, size = [], 0
            for n, p in rest:
                current.append((n, p))
                size += p.numel()
                if size >= limit:
                    groups.append((current, None, False))
                    current, size = [], 0
            if current:
                groups.append((current, None, False))
            if tied:
                groups.append((tied, None, True))
        buckets = []
        for params, unit, deferred in groups:
            offsets, total = [], 0
            for _, p in params:
                offsets.append(total)
                total += p.numel()
            numel = -(-total // self.dp) * self.dp
            buckets.append(Bucket(params=params, offsets=offsets, numel=numel, unit=unit, deferred=deferred,
                                  dp=self.dp))
        return buckets

    def _materialise(self) -> None:
        """Move the parameters into the bucket buffers; build master weights and moments for the own range."""
        tp_rank = self.grid.tp_comm.rank
        for b in self.buckets:
            master_full = torch.zeros(b.numel, dtype=torch.float32, device=self.device)
            decay = torch.zeros(b.numel, dtype=torch.bool, device=self.device)
            count = torch.zeros(b.numel, dtype=torch.bool, device=self.device)
            sp = torch.zeros(b.numel, dtype=torch.bool, device=self.device)
            b.full = torch.zeros(b.numel, dtype=self.dtype, device=self.device)
            if self.stage == 3:  # whole while it is filled: counted, so the _free below balances
                self.gathered_bytes += b.numel * b.full.element_size()
            for (name, p), off in zip(b.params, b.offsets):
                n = p.numel()
                value = p.detach() if not p.is_meta else self.initial_value(p)
                master_full[off:off + n] = value.reshape(-1).float()
                decay[off:off + n] = p.dim() >= 2
                count[off:off + n] = (getattr(p, "tp_split_dim", None) is not None or tp_rank == 0) \
                    and not getattr(p, "tied_copy", False)
                sp[off:off + n] = bool(getattr(p, "sequence_parallel", False))
                b.full[off:off + n] = value.reshape(-1).to(self.dtype)
                if p.is_meta:  # becomes a real tensor in place (same Parameter object, its attributes kept)
                    real = nn.Parameter(b.full[off:off + n].view(p.shape), requires_grad=p.requires_grad)
                    real.__dict__.update(p.__dict__)
                    torch.utils.swap_tensors(p, real)
                else:
                    p.data = b.full[off:off + n].view_as(p)
            lo, hi = self._range(b)
            keep_master = self.dtype != torch.float32 or self.state_device != self.device \
                or (self.stage == 3 and self.param_device != self.state_device)
            if self.stage == 3:
                b.shard_param = b.full[lo:hi].clone().to(self.param_device)
                if self.device.type == "cuda" and self.param_device.type == "cpu":
                    b.shard_param = b.shard_param.pin_memory()
            if keep_master:
                b.master = master_full[lo:hi].clone().to(self.state_device)
            else:  # fp32 on the device: the parameter slice itself is the master copy
                b.master = (b.shard_param if self.stage == 3 else b.full[lo:hi])
            b.exp_avg = torch.zeros(hi - lo, dtype=torch.float32, device=self.state_device)
            b.exp_avg_sq = torch.zeros(hi - lo, dtype=torch.float32, device=self.state_device)
            if self.device.type == "cuda":  # offloaded states in page-locked memory: fast, asynchronous copies
                if self.state_device.type == "cpu":
                    b.exp_avg, b.exp_avg_sq = b.exp_avg.pin_memory(), b.exp_avg_sq.pin_memory()
                    if keep_master:
                        b.master = b.master.pin_memory()
            b.decay_mask, b.norm_mask = decay[lo:hi].clone(), count[lo:hi].clone()
            sp_index = sp[lo:hi].nonzero().squeeze(1)  # once here, so the step indexes without a host sync
            b.sp_index = sp_index if sp_index.numel() else None
            if self.state_device != self.device:
                b.decay_mask = b.decay_mask.to(self.state_device)
            if self.stage == 0 or self.stage == 1:
                b.grad = torch.zeros(b.numel, dtype=self.grad_dtype, device=self.device)
            if self.stage >= 1:
                b.shard_grad = torch.zeros(hi - lo, dtype=self.grad_dtype, device=self.device)
            if self.stage == 3:
                self._free(b)

    def _range(self, b: Bucket) -> tuple[int, int]:
        """The optimizer's range of a bucket on this rank: all of it (stage 0) or the own slice."""
        if self.stage == 0:
            return 0, b.numel
        return self.dp_rank * b.shard, (self.dp_rank + 1) * b.shard

    # ----- the step ---------------------------------------------------------------------------
    def step(self, lr: float, max_norm: float, loss: Optional[Tensor] = None,
             flags: Optional[Tensor] = None) -> tuple[float, bool]:
        """Reduce, clip and update; returns (global grad norm, skipped because of an overflow).

        A non-finite gradient anywhere, or a non-finite ``loss`` (this rank's loss sum, if it holds one), skips
        the update on every rank; ``nonfinite_param`` then names the first parameter (on this rank) with a
        non-finite gradient, if any. ``flags`` are the caller's per-rank 0/1 values (a stop request, say):
        they are reduced with MAX over every rank in place, in the step's one world all-reduce, so every rank
        agrees on them at no extra collective."""
        self.reduce()
        self.nonfinite_param = None
        inv_scale = 1.0 / self.scaler.scale if self.scaler.enabled else 1.0
        device = self.device
        sumsq = torch.zeros((), dtype=torch.float32, device=device)
        for b in self.buckets:
            g = self._range_grad(b).float()
            sumsq += (g * g * b.norm_mask).sum()
        bad = torch.isfinite(sumsq).logical_not()
        if loss is not None:
            bad = bad | torch.isfinite(loss).logical_not()
        agreed = bad.float().reshape(1) if flags is None else torch.cat([bad.float().reshape(1), flags.float()])
        self.world.all_reduce(agreed, op=dist.ReduceOp.MAX, tag="overflow")
        if flags is not None:
            flags.copy_(agreed[1:])
        if self.stage >= 1:
            self.grid.dp_comm.all_reduce(sumsq, tag="grad_norm")
        self.grid.tp_comm.all_reduce(sumsq, tag="grad_norm")
        self.grid.pp_comm.all_reduce(sumsq, tag="grad_norm")
        flag, root = torch.stack([agreed[0], sumsq.sqrt()]).tolist()  # the step's one wait for the device
        skipped = bool(flag)
        self.scaler.update(skipped)
        norm = root * inv_scale
        if skipped:
            if not self.scaler.enabled:  # outside fp16 every overflow is an anomaly: say where (rare path)
                self.nonfinite_param = self._first_nonfinite_grad()
            self.zero_grad()
            if self.stage == 3:
                self.release()  # the root stays gathered otherwise, until the next step's forward
            return norm, True
        self.step_count += 1
        coef = min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0
        b1, b2 = self.betas
        # Offloaded states: every bucket's gradient leaves the device at once (asynchronous copies into pinned
        # memory), then one wait, not one blocking copy per bucket. On the device this is a no-op.
        grads = [self._range_grad(b).to(self.state_device, non_blocking=True) for b in self.buckets]
        if self.state_device != device and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        for b, grad in zip(self.buckets, grads):
            lo, hi = self._range(b)
            target = b.shard_param if self.stage == 3 else b.full[lo:hi]
            same = b.master.data_ptr() == target.data_ptr()
            adamw(self.adam_impl, b.master, grad, b.exp_avg, b.exp_avg_sq, lr=lr, beta1=b1, beta2=b2, eps=self.eps,
                       weight_decay=self.weight_decay, step=self.step_count, decay_mask=b.decay_mask,
                       grad_scale=inv_scale * coef, model_copy=None if same else target)
        self._gather_updated()
        self.zero_grad()
        return norm, False

    def _first_nonfinite_grad(self) -> Optional[str]:
        """The first parameter, in bucket order, whose gradient has a non-finite element in this rank's range."""
        for b in self.buckets:
            bad = torch.isfinite(self._range_grad(b)).logical_not().nonzero()
            if bad.numel():
                at = self._range(b)[0] + int(bad[0, 0])
                return next((n for (n, p), off in zip(b.params, b.offsets) if off <= at < off + p.numel()), None)
        return None

    def _gather_updated(self) -> None:
        """Stages 1-2: every rank updated its slice; all-gather the buckets. Stage 3 keeps slices only."""
        if self.stage in (1, 2):
            for b in self.buckets:
                self.grid.dp_comm.all_gather_into(b.full, b.full[self._range(b)[0]:self._range(b)[1]].clone(),
                                                  tag="param")
        elif self.stage == 3:
            self.release()

    def zero_grad(self) -> None:
        for b in self.buckets:
            if b.grad is not None and self.stage <= 1:
                b.grad.zero_()
            elif self.stage >= 2:
                b.grad = None
            if b.shard_grad is not None:
                b.shard_grad.zero_()

    # ----- accounting -------------------------------------------------------------------------
    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds persistently, by kind and place (what the dry-run plans)."""
        dev = {"params": 0, "grads": 0, "optimizer": 0}
        cpu = 0
        for b in self.buckets:
            lo, hi = self._range(b)
            if self.stage == 3:
                n = b.shard_param.numel() * b.shard_param.element_size()
                if self.param_device.type == "cpu" and self.device.type != "cpu":
                    cpu += n
                else:
                    dev["params"] += n
            else:
                dev["params"] += b.full.numel() * b.full.element_size()
            grads = b.grad if self.stage <= 1 else b.shard_grad
            dev["grads"] += grads.numel() * grads.element_size()
            states = [b.exp_avg, b.exp_avg_sq]
            if b.master.data_ptr() not in (b.full.data_ptr() + lo * b.full.element_size(),
                                           b.shard_param.data_ptr() if b.shard_param is not None else -1):
                states.append(b.master)
            opt = sum(t.numel() * t.element_size() for t in states)
            if self.state_device.type == "cpu" and self.device.type != "cpu":
                cpu += opt
            else:
                dev["optimizer"] += opt
        return {**dev, "cpu": cpu}


def _named(chunk: nn.Module, layer: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """A layer's parameters under their global names."""
    prefix = next(n for n, m in chunk.named_modules() if m is layer)
    return [(f"{prefix}.{n}", p) for n, p in layer.named_parameters()][::-1]

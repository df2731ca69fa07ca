"""ZeRO checkpoints: every parameter's state whole, under its name, written by one dp rank.

A checkpoint stores each parameter and its optimizer state (fp32 master, Adam moments) whole and
under the parameter's name, whatever the (tp, pp, dp, stage) layout, so it loads at any other.
Holding a stage's whole state on every dp rank for a save would cost dp times what ZeRO keeps per
rank, so each parameter has one owner among the dp ranks (``BucketLayout.owner``, balanced by size): a
save gathers one bucket at a time and the owners keep their parameters' tensors for DCP to write; a load
hands the owners' tensors back to everyone with one sum over dp per bucket (a single non-zero term: exact).
"""
from __future__ import annotations

import torch
from torch import Tensor

from megazero.parallel.comm import Comm
from megazero.parallel.zero.update import Update
from megazero.parallel.zero.layout import Bucket, BucketLayout
from megazero.parallel.zero.policy import StagePolicy

KINDS = ("param", "master", "exp_avg", "exp_avg_sq")


class ZeroCheckpoint:
    def __init__(self, layout: BucketLayout, policy: StagePolicy, optim: Update, dp: Comm,
                 device: torch.device, host_ok: bool = True):
        """host_ok: offloaded states may be handed to the checkpoint in host memory (False where the caller
        wraps them in DTensors on a device mesh, which would copy them to the device anyway)."""
        self.layout, self.policy, self.optim, self.dp, self.device = layout, policy, optim, dp, device
        self.on_host = optim.offloaded() and host_ok

    def _full(self, b: Bucket, local: Tensor) -> Tensor:
        """A bucket-long tensor from this rank's slice of it, gathered over dp (a sharded optimizer)."""
        out = torch.empty(b.numel, dtype=local.dtype, device=self.device)
        self.dp.all_gather_into(out, local.to(self.device).contiguous(), tag="checkpoint")
        return out

    def _params(self, b: Bucket) -> Tensor:
        return self._full(b, self.layout.shard_values(b)) if self.policy.shard_params else b.full

    def full_parameters(self) -> dict[str, Tensor]:
        """Every parameter of the stage by name, whole (tp-local) copies; gathered over dp when sharded.

        For inspection and benchmarks: it holds the whole stage at once."""
        out = {}
        for b in self.layout.buckets:
            flat = self._params(b)
            for (name, p), off in zip(b.params, b.offsets):
                out[name] = flat[off:off + p.numel()].view(p.shape).clone()
        return out

    def export_state(self) -> dict[str, dict[str, Tensor]]:
        """name -> {param, master, exp_avg, exp_avg_sq} as whole (tp-local) tensors, for the parameters this dp
        rank owns: every rank holds ~1/dp of the stage's state, plus one gathered bucket at a time."""
        o = self.optim
        out: dict[str, dict[str, Tensor]] = {}
        for b in self.layout.buckets:
            i = b.index
            owned = [(name, p, off) for (name, p), off in zip(b.params, b.offsets)
                     if self.layout.owner[name] == self.layout.dp_rank]
            states = o.bucket_states(i)
            # between 0/1 Adam's synchronisations each rank's weights are its own: the checkpoint's are the last
            # synchronisation's, its masters (the rank's own come back from its per-rank state on a load)
            own = o.wrote_whole_params()
            if not self.policy.shard_optimizer:  # nothing to gather: this rank's own buffers, read where they are
                # (offloaded: from host memory) unless they must go to the device for the tp-mesh DTensors, whose
                # local tensors DCP fills on a load
                kinds = {"param": b.full, **{k: v if self.on_host else v.to(self.device) for k, v in states.items()}}
                if own:
                    kinds["param"] = kinds["master"].to(self.layout.dtype)
            else:  # every rank takes part in the gathers (one bucket on the device at a time), owner or not
                kinds = {"param": self._params(b), **{k: self._full(b, v.float()) for k, v in states.items()}}
                if own:
                    kinds["param"] = kinds["master"].to(self.layout.dtype)
            for name, p, off in owned:
                out[name] = {k: self._keep(v[off:off + p.numel()].view(p.shape)) for k, v in kinds.items()}
            del kinds  # before the next bucket's gathers: one bucket on the device at a time
        return out

    def _keep(self, t: Tensor) -> Tensor:
        """The owner's copy for the checkpoint; an offloaded run keeps it in host memory, the parameters' copy
        too (the device holds one bucket of the save at a time)."""
        return t.to("cpu", copy=True) if self.on_host else t.clone()

    def import_state(self, state: dict[str, dict[str, Tensor]], step: int) -> None:
        """Take back what export_state gave (after a checkpoint filled it): the owners' whole tensors go into
        bucket-long buffers, zero elsewhere; a sum over dp then hands every rank its range (exact: one term)."""
        o = self.optim
        for b in self.layout.buckets:
            i = b.index
            flat = {k: torch.zeros(b.numel, dtype=torch.float32 if k != "param" else self.layout.dtype,
                                   device=self.device) for k in KINDS}
            for (name, p), off in zip(b.params, b.offsets):
                if name in state:
                    for k, t in flat.items():
                        # the model copy is the master rounded to this run's dtype: a checkpoint of another
                        # precision (bf16 saved, fp32 resumed, where master and parameter are one buffer) too
                        src = state[name]["master" if k == "param" else k]
                        t[off:off + p.numel()] = src.reshape(-1).to(device=t.device, dtype=t.dtype)
            lo, hi = self.layout.range(b)
            mine = {}
            for k, t in flat.items():
                whole = k == "param" and not self.policy.shard_params  # every rank holds every parameter
                if whole or not self.policy.shard_optimizer:
                    self.dp.all_reduce(t, tag="checkpoint")
                    mine[k] = t if whole else t[lo:hi]
                else:
                    mine[k] = torch.empty(hi - lo, dtype=t.dtype, device=self.device)
                    self.dp.reduce_scatter_into(mine[k], t, tag="checkpoint")
            if self.policy.shard_params:
                self.layout.set_shard(b, mine["param"])
            else:
                b.full.copy_(mine["param"])
            o.load_bucket_states(i, mine)
        o.step_count = step

"""ZeRO checkpoints: every parameter's state whole, under its name, written by one dp rank.

A checkpoint stores each parameter and its optimizer state (fp32 master, Adam moments) whole and
under the parameter's name, whatever the (tp, pp, dp, stage) layout, so it loads at any other.
Holding a stage's whole state on every dp rank for a save would cost dp times what ZeRO keeps per
rank, so each parameter has one owner among the dp ranks (balanced by size): a save gathers one
bucket at a time and the owners keep their parameters' tensors for DCP to write; a load hands the
owners' tensors back to everyone with one sum over dp per bucket (a single non-zero term: exact).
"""
from __future__ import annotations

import torch
from torch import Tensor

from parallel.zero_params import Bucket


class ZeroCheckpointing:
    """Checkpoint export/import for :class:`parallel.zero.ZeroOptimizer` (its buckets, grid, stage, device)."""

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

    def _full(self, b: Bucket, local: Tensor) -> Tensor:
        """A bucket-long tensor from this rank's range of it, gathered over dp (stages 1-3; stage 0 holds it all)."""
        assert self.stage > 0, "stage 0 holds whole buckets"
        out = torch.empty(b.numel, dtype=local.dtype, device=self.device)
        self.grid.dp_comm.all_gather_into(out, local.to(self.device).contiguous(), tag="checkpoint")
        return out

    def full_parameters(self) -> dict[str, Tensor]:
        """Every parameter of the stage by name, whole (tp-local) copies; gathered over dp under stage 3.

        For inspection and benchmarks: it holds the whole stage at once."""
        out = {}
        for b in self.buckets:
            flat = b.full if self.stage < 3 else self._full(b, b.shard_param)
            for (name, p), off in zip(b.params, b.offsets):
                out[name] = flat[off:off + p.numel()].view(p.shape).clone()
        return out

    def export_state(self) -> dict[str, dict[str, Tensor]]:
        """name -> {param, master, exp_avg, exp_avg_sq} as whole (tp-local) tensors, for the parameters this dp
        rank owns (:attr:`owner`): every rank holds ~1/dp of the stage's state, plus one gathered bucket at a time.

        Used only for checkpoints (DCP writes each owner's tensors; the dp ranks together write everything).
        """
        out: dict[str, dict[str, Tensor]] = {}
        for b in self.buckets:
            owned = [(name, p, off) for (name, p), off in zip(b.params, b.offsets) if self.owner[name] == self.dp_rank]
            if self.stage == 0:  # nothing to gather: this rank's own buffers (offloaded ones come to the device,
                # where the checkpoint's tp-mesh DTensors live: DCP must fill these very tensors on a load)
                kinds = {"param": b.full, "master": b.master.to(self.device), "exp_avg": b.exp_avg.to(self.device),
                         "exp_avg_sq": b.exp_avg_sq.to(self.device)}
            else:  # every rank takes part in the gathers, owner or not
                kinds = {"param": b.full if self.stage < 3 else self._full(b, b.shard_param),
                         "exp_avg": self._full(b, b.exp_avg), "exp_avg_sq": self._full(b, b.exp_avg_sq),
                         "master": self._full(b, b.master.float())}
            for name, p, off in owned:
                out[name] = {k: v[off:off + p.numel()].view(p.shape).clone() for k, v in kinds.items()}
        return out

    def import_state(self, state: dict[str, dict[str, Tensor]], step: int) -> None:
        """Take back what export_state gave (after a checkpoint filled it): the owners' whole tensors go into
        bucket-long buffers, zero elsewhere; a sum over dp then hands every rank its range (exact: one term)."""
        for b in self.buckets:
            flat = {k: torch.zeros(b.numel, dtype=torch.float32 if k != "param" else self.dtype, device=self.device)
                    for k in ("param", "master", "exp_avg", "exp_avg_sq")}
            for (name, p), off in zip(b.params, b.offsets):
                if name in state:
                    for k, t in flat.items():
                        # the model copy is the master rounded to this run's dtype: a checkpoint of another
                        # precision (bf16 saved, fp32 resumed, where master and parameter are one buffer) too
                        src = state[name]["master" if k == "param" else k]
                        t[off:off + p.numel()] = src.reshape(-1).to(device=t.device, dtype=t.dtype)
            lo, hi = self._range(b)
            mine = {}
            for k, t in flat.items():
                whole = k == "param" and self.stage < 3  # stages 0-2 hold every parameter
                if whole or self.stage == 0:
                    self.grid.dp_comm.all_reduce(t, tag="checkpoint")
                    mine[k] = t if whole else t[lo:hi]
                else:
                    mine[k] = torch.empty(hi - lo, dtype=t.dtype, device=self.device)
                    self.grid.dp_comm.reduce_scatter_into(mine[k], t, tag="checkpoint")
            if self.stage < 3:
                b.full.copy_(mine["param"])
            else:
                b.shard_param.copy_(mine["param"])
            if b.master.data_ptr() != (b.shard_param if self.stage == 3 else b.full[lo:hi]).data_ptr():
                b.master.copy_(mine["master"])
            b.exp_avg.copy_(mine["exp_avg"])
            b.exp_avg_sq.copy_(mine["exp_avg_sq"])
        self.step_count = step

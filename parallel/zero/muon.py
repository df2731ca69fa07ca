"""Muon on this rank's share of the flat buffers: the hidden matrices orthogonalised whole, the rest on AdamW.

Jordan et al. 2024 (the algorithm) with Liu et al. 2025, "Muon is Scalable for LLM Training", section 2.2 (the
decay and the scale): per matrix W (m x n) with gradient G,

    M <- mu M + G;  U = G + mu M (Nesterov) or M;  O = NS5(U) * 0.2 sqrt(max(m, n));  W <- W - lr (O + wd W)

where NS5 is five Newton-Schulz steps (``kernels.newton_schulz``) and the factor 0.2 sqrt(max(m, n)) gives O
the RMS of an AdamW update, so AdamW's learning rate and decay carry over. The matrices are the 2-D
parameters of the model's layers (its declared sharding units, stacked experts one matrix each); the
embeddings, the head and every vector stay on AdamW in the same step, at ``adamw_lr``.

The momentum is elementwise, so each rank keeps its slice of it (in AdamW's first-moment buffer: the
checkpoint, the ZeRO formulas and the layout-free resume are AdamW's). Newton-Schulz needs the whole matrix:
``parallel.zero.matrix_plan`` says which rank assembles which, and each round gathers one matrix per rank
over the stage's ranks and scatters the updates back (two all-to-alls, 2 x the matrices' elements per step).
The second-moment buffer of a Muon matrix stays zero (kept for a uniform layout: 4 bytes per element).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from megazero.kernels.adam_cpu import Run
from megazero.kernels.newton_schulz import STEPS, newton_schulz
from megazero.parallel.comm import Comm
from megazero.parallel.zero.adamw import ShardedAdamW
from megazero.parallel.zero.declared import sharding_units
from megazero.parallel.zero.layout import Bucket, BucketLayout
from megazero.parallel.zero.matrix_plan import Matrix, MatrixPlan, StagePlace, stage_matrices

SCALE = 0.2  # Liu et al. 2025: O's RMS matched to AdamW's (~0.2-0.4 in practice)
ADAMW_GROUP = 2 ** 22  # elements per group of the AdamW part's views: its temporaries stay under 16 MB


@dataclass(frozen=True)
class MuonSettings:
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = STEPS
    adamw_lr_ratio: float = 1.0  # the AdamW parameters' learning rate over the matrices'


def muon_matrices(chunks: list[nn.Module]) -> dict[int, bool]:
    """id(parameter) -> True for the matrices Muon takes: the 2-D (and stacked-expert 3-D) parameters of each
    chunk's declared sharding units (its layers), not the embeddings, the head or any vector."""
    out: dict[int, bool] = {}
    for chunk in chunks:
        for _, unit in sharding_units(chunk):
            for p in unit.parameters():
                out[id(p)] = p.dim() == 2 or (p.dim() == 3 and getattr(p, "ep_split_dim", None) == 0)
    return out


class ShardedMuon(ShardedAdamW):
    def __init__(self, layout: BucketLayout, device: torch.device, weight_decay: float, betas: tuple[float, float],
                 eps: float, grad_dtype: torch.dtype, is_matrix: dict[int, bool], stage: Comm, place: StagePlace,
                 settings: MuonSettings):
        """``is_matrix[id(p)]``: the parameters Muon updates (the rest take AdamW, at ``settings.adamw_lr_ratio``
        times the step's learning rate); ``stage``: every rank of this pipeline stage, placed by ``place``."""
        super().__init__(layout, device, device, "fused", weight_decay, betas, eps, grad_dtype)
        self.settings = settings
        self.stage = stage
        assert stage.size == place.stage_size, (stage, place)
        matrices = stage_matrices(layout, is_matrix, place.tp, place.ep)
        self.plan = MatrixPlan(layout, matrices, place, stage.rank, settings.ns_steps)
        # per bucket, the positions of its Muon parameters (the objects may be replaced when materialised)
        self.muon_params = [{j for j, (_, p) in enumerate(b.params) if is_matrix.get(id(p), False)}
                            for b in layout.buckets]
        n = len(layout.buckets)
        self.muon_runs: list[list[tuple[int, int]]] = [[] for _ in range(n)]  # of the range, per bucket
        self.adam_runs: list[list[Run]] = [[] for _ in range(n)]  # (start, end, decays), the rest
        self.update_sq: Optional[Tensor] = None  # sum of squares of the last step's O over the owned matrices
        self.update_numel = sum(r.matrix.numel * r.matrix.positions for r in self.plan.rounds if r.matrix)

    def add_bucket(self, b: Bucket, initial: Tensor, decay: list[Run], count: list[Run]) -> None:
        super().add_bucket(b, initial, decay, count)
        lo, hi = self.layout.range(b)
        muon = []
        for j, ((_, p), off) in enumerate(zip(b.params, b.offsets)):
            a, z = max(off, lo) - lo, min(off + p.numel(), hi) - lo
            if a < z and j in self.muon_params[b.index]:
                muon.append((a, z))
        self.muon_runs[b.index] = muon
        rest, at = [], 0
        for a, z, decays in decay:  # the decay runs tile the range: cut the Muon runs out of them
            for ma, mz in muon:
                if ma < z and mz > a:
                    if a < ma:
                        rest.append((a, ma, decays))
                    a = mz
            if a < z:
                rest.append((a, z, decays))
            at = z
        assert at == hi - lo, (at, hi - lo)
        self.adam_runs[b.index] = rest

    # ----- the update -----------------------------------------------------------------------------------------
    def update(self, grads: list[Tensor], lr: float, grad_scale: float, resend: set[int]) -> None:
        """One step: AdamW on the vectors, embeddings and head, Muon on the matrices; ``grad_scale`` folds
        loss-scale unscaling and clipping."""
        self.step_count += 1
        grads = self.state_grads(grads, resend)
        fp32 = []
        for g in grads:
            g = g if g.dtype == torch.float32 else g.float()
            if grad_scale != 1.0:
                g.mul_(grad_scale)
            fp32.append(g)
        self._adamw(fp32, lr * self.settings.adamw_lr_ratio)
        # momentum and the Nesterov direction, written over the gradient (the step consumes it)
        ms = [self.exp_avg[i][a:z] for i, runs in enumerate(self.muon_runs) for a, z in runs]
        us = [fp32[i][a:z] for i, runs in enumerate(self.muon_runs) for a, z in runs]
        if ms:
            mu = self.settings.momentum
            torch._foreach_mul_(ms, mu)
            torch._foreach_add_(ms, us)
            if self.settings.nesterov:
                torch._foreach_add_(us, ms, alpha=mu)
            else:
                torch._foreach_copy_(us, ms)
        self._orthogonalise(fp32)
        masters = [self.master[i][a:z] for i, runs in enumerate(self.muon_runs) for a, z in runs]
        if masters:
            if self.weight_decay:
                torch._foreach_mul_(masters, 1.0 - lr * self.weight_decay)
            torch._foreach_add_(masters, us, alpha=-lr)
        for b in self.layout.buckets:
            if not self.master_is_param[b.index]:
                target = self.target(b)
                target.copy_(self.master[b.index], non_blocking=target.device.type == "cuda")

    def _adamw(self, grads: list[Tensor], lr: float) -> None:
        """AdamW (``kernels.adam.adamw_step``'s operations) over the runs Muon leaves, decaying and not, in
        groups of at most ADAMW_GROUP elements: the denominator is a temporary, and an embedding's run is long."""
        b1, b2 = self.betas
        bc1, bc2_sqrt = 1.0 - b1 ** self.step_count, math.sqrt(1.0 - b2 ** self.step_count)
        for decays in (True, False):
            cuts = [(i, lo, min(lo + ADAMW_GROUP, z)) for i, runs in enumerate(self.adam_runs)
                    for a, z, d in runs if d == decays for lo in range(a, z, ADAMW_GROUP)]
            group, size = [], 0
            for k, cut in enumerate(cuts):
                group.append(cut)
                size += cut[2] - cut[1]
                if size >= ADAMW_GROUP or k == len(cuts) - 1:
                    self._adamw_views(group, grads, lr, decays, bc1, bc2_sqrt)
                    group, size = [], 0

    def _adamw_views(self, views: list[tuple[int, int, int]], grads: list[Tensor], lr: float, decays: bool,
                     bc1: float, bc2_sqrt: float) -> None:
        b1, b2 = self.betas
        p = [self.master[i][a:z] for i, a, z in views]
        g = [grads[i][a:z] for i, a, z in views]
        m = [self.exp_avg[i][a:z] for i, a, z in views]
        v = [self.exp_avg_sq[i][a:z] for i, a, z in views]
        if decays and self.weight_decay:
            torch._foreach_mul_(p, 1.0 - lr * self.weight_decay)
        torch._foreach_lerp_(m, g, 1.0 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, g, g, value=1.0 - b2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, bc2_sqrt)
        torch._foreach_add_(denom, self.eps)
        torch._foreach_addcdiv_(p, m, denom, value=-lr / bc1)

    def _orthogonalise(self, directions: list[Tensor]) -> None:
        """Replace each matrix's direction (in ``directions``' Muon runs) by its scaled Newton-Schulz image: per
        round, gather one matrix to each owner, orthogonalise, scatter the pieces back."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for r in self.plan.rounds:
            send = [directions[i][a:z] for peer in r.gather_send for i, a, z in peer]
            received = self._all_to_all(send, [sum(z - a for a, z in spans) for spans in r.gather_recv],
                                        [sum(z - a for _, a, z in peer) for peer in r.gather_send])
            out = None
            if r.matrix is not None:
                whole = torch.empty(r.matrix.numel * r.matrix.positions, dtype=torch.float32, device=self.device)
                at = 0
                for spans in r.gather_recv:
                    for a, z in spans:
                        whole[a:z] = received[at:at + z - a]
                        at += z - a
                out = self._orthogonal(r.matrix, whole)
                sq += out.double().square().sum()
            back = [out[a:z] for spans in r.scatter_send for a, z in spans]
            received = self._all_to_all(back, [sum(z - a for _, a, z in peer) for peer in r.scatter_recv],
                                        [sum(z - a for a, z in spans) for spans in r.scatter_send])
            at = 0
            for peer in r.scatter_recv:
                for i, a, z in peer:
                    directions[i][a:z] = received[at:at + z - a]
                    at += z - a
        self.update_sq = sq

    def _orthogonal(self, m: Matrix, whole: Tensor) -> Tensor:
        """The scaled update of one assembled matrix (tp shards stored one after another), in the same layout."""
        rows, cols = m.shape
        if m.split_dim == 1:  # shards side by side: (positions, rows, cols) -> (rows, positions * cols)
            x = whole.view(m.positions, rows, cols).permute(1, 0, 2).reshape(rows, m.positions * cols)
        else:
            x = whole.view(*m.logical_shape)
        o = newton_schulz(x, self.settings.ns_steps).mul_(SCALE * math.sqrt(max(m.logical_shape)))
        if m.split_dim == 1:
            o = o.view(rows, m.positions, cols).permute(1, 0, 2)
        return o.reshape(-1)

    def _all_to_all(self, pieces: list[Tensor], recv: list[int], send: list[int]) -> Tensor:
        x = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.float32, device=self.device)
        return self.stage.all_to_all(x, recv, send, tag="muon")

    def update_rms(self) -> Optional[Tensor]:
        """(sum of squares, elements) of the last step's matrix updates owned here (None before the first)."""
        if self.update_sq is None:
            return None
        return torch.stack([self.update_sq, torch.tensor(float(self.update_numel), dtype=torch.float64,
                                                         device=self.update_sq.device)])

"""A mixture-of-experts MLP (Shazeer et al. 2017; Fedus et al. 2022): a router sends each token to k of E
SwiGLU experts and sums their outputs weighted by its gate; optional shared experts see every token.

Two routers, as published:

- ``softmax`` (Mixtral, Jiang et al. 2024; Qwen3-MoE): softmax over the E logits, the top k, renormalised to
  sum to 1 when ``norm_topk_prob``;
- ``sigmoid`` (DeepSeek-V3, Liu et al. 2024, §2.1.2): sigmoid affinities; a per-expert bias, used only to
  *select* the top k, moved after each step by ``bias_update_rate`` toward balanced load (auxiliary-loss-free
  balancing); the gates are the selected affinities normalised, times ``routed_scaling_factor``.

Dropless by default: every copy reaches its expert, so the result does not depend on the layout. The copies
are sorted by expert (one stable sort), sent to their experts' ranks (``parallel.experts``), computed as one
grouped matmul per projection (``kernels.grouped``), returned and summed into their tokens by gate.

Each tp rank routes its own part of the sequence (with sequence parallelism, the part it holds; without, its
slice of the whole, gathered back after), so no expert computes a token twice, and the router's and
experts' gradients are partial over tp: they are marked ``sequence_parallel`` and summed over tp like the
norms'. Expert weights are stacked logical tensors ``experts.gate`` (E, f, h), ``experts.up`` (E, f, h),
``experts.down`` (E, h, f), split over ep along dim 0, reduced over their edp group (``reduce_group``).

Balancing terms, each a sum over tokens divided by the global batch's tokens, as the main loss, so its value
does not depend on the layout: the Switch load-balancing loss per sequence (E·Σ f_e P_e, with f_e the
sequence's share of assignments to e and P_e its mean router probability; DeepSeek-V3's sequence-wise form),
and the router z-loss (Zoph et al. 2022, §3.5) per token. A sequence split over tp or cp ranks has its f_e
summed over them, so every rank weighs its own tokens' P_e by the whole sequence's shares. They reach backward
through the layer's output (``_AttachLoss``), weighted by the loss scale over the global batch's tokens the
executor sets.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megazero.kernels.grouped import grouped_mm
from megazero.models.arch import ffn_hidden
from megazero.models.llama import SwiGLU
from megazero.models.split import Split
from megazero.parallel.experts import combine, dispatch, is_fake, plan_dispatch
from megazero.parallel.regions import gather_to_whole, split_to_sequence
from megazero.parallel.tp_random import ShardedDropout

if TYPE_CHECKING:
    from megazero.models.config import ModelConfig

STATS = ("aux_loss", "z_loss", "dropped", "tokens")  # after the E per-expert counts in a layer's statistics


class _AttachLoss(torch.autograd.Function):
    """Identity on ``y``; in backward, d(loss)/d(aux) = ``weight``: the auxiliary loss joins the backward of the
    stage that computed it, without passing through the pipeline."""

    @staticmethod
    def forward(ctx, y: Tensor, aux: Tensor, weight: float) -> Tensor:
        ctx.weight = weight
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, torch.full((), ctx.weight, dtype=torch.float32, device=grad.device), None


def _count(chosen: Tensor, experts: int) -> Tensor:
    """Copies per expert: a scatter of fixed size (``bincount``'s size depends on the values, which a simulated
    run cannot read)."""
    return torch.zeros(experts, dtype=torch.long, device=chosen.device).scatter_add_(0, chosen,
                                                                                    torch.ones_like(chosen))


class Router(nn.Module):
    """Logits (tokens, E) from a replicated (E, h) weight; the sigmoid router's selection bias is a buffer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.weight = nn.Parameter(torch.empty(moe.experts, cfg.hidden))
        self.register_buffer("expert_bias", torch.zeros(moe.experts, dtype=torch.float32)
                             if moe.router == "sigmoid" else None, persistent=False)


def route(logits: Tensor, moe: Any, bias: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """(expert indices (T, k), gates (T, k), router probabilities (T, E)) from float32 logits."""
    k = moe.top_k
    if moe.router == "softmax":
        probs = logits.softmax(-1)
        gates, idx = probs.topk(k, dim=-1)
    else:
        scores = logits.sigmoid()
        idx = (scores + bias if bias is not None else scores).topk(k, dim=-1).indices
        gates = scores.gather(1, idx)
        probs = scores / scores.sum(-1, keepdim=True)  # the balance loss's normalised affinities
    if moe.norm_topk_prob and k > 1:
        gates = gates / gates.sum(-1, keepdim=True)
    return idx, gates * moe.routed_scaling_factor, probs


class GroupedExperts(nn.Module):
    """This ep rank's experts [first, first + local): their SwiGLUs as grouped matmuls over sorted rows."""

    def __init__(self, cfg: ModelConfig, par: Split):
        super().__init__()
        moe, h = cfg.moe, cfg.hidden
        f = moe.expert_hidden or ffn_hidden(cfg)
        ep_size, ep_rank = par.ep.size, par.ep.rank
        assert moe.experts % ep_size == 0, (moe.experts, ep_size)
        self.local = moe.experts // ep_size
        self.first = ep_rank * self.local
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.gate = nn.Parameter(torch.empty(self.local, f, h))
        self.up = nn.Parameter(torch.empty(self.local, f, h))
        self.down = nn.Parameter(torch.empty(self.local, h, f))
        self.impl = "auto"
        for p in (self.gate, self.up, self.down):
            p.ep_split_dim = 0  # the logical tensor stacks all E experts; this rank holds its slice
            p.reduce_group = "edp"  # summed over the ranks that hold the same experts, not over dp

    def forward(self, x: Tensor, sizes: list[int]) -> Tensor:
        if is_fake(x) and len(set(sizes)) == 1:  # a simulated step: balanced groups as one batched matmul (the
            return self._batched(x, len(sizes))  # fake grouped matmul takes bf16 only), the same shapes and bytes
        offsets = None
        if self.impl != "loop":
            offsets = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(x.device)
        gate = grouped_mm(x, self.gate, sizes, offsets, self.impl)
        up = grouped_mm(x, self.up, sizes, offsets, self.impl)
        return grouped_mm(F.silu(gate) * up, self.down, sizes, offsets, self.impl)


    def _batched(self, x: Tensor, groups: int) -> Tensor:
        def bmm(a: Tensor, w: Tensor) -> Tensor:
            return torch.bmm(a.view(groups, -1, a.shape[-1]), w.to(a.dtype).transpose(1, 2)).reshape(-1, w.shape[1])

        return bmm(F.silu(bmm(x, self.gate)) * bmm(x, self.up), self.down)


class MoE(nn.Module):
    """The mixture-of-experts MLP of one layer (``forward(x)``: (b, s or s/tp, h) -> the same)."""

    def __init__(self, cfg: ModelConfig, par: Split):
        super().__init__()
        self.moe, self.seq_len = cfg.moe, cfg.seq_len
        self.tp, self.sp, self.ep = par.tp if par.size > 1 else None, par.sp, par.ep
        self.par = par
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg, par)
        width = cfg.moe.shared_experts * (cfg.moe.expert_hidden or ffn_hidden(cfg))
        self.shared = SwiGLU(cfg, par, width=width) if cfg.moe.shared_experts else None
        self.dropout = ShardedDropout(cfg.dropout, par.rng, split=par.sp)
        if par.size > 1:  # each tp rank routes its own tokens: partial gradients, summed over tp
            for p in (self.router.weight, self.experts.gate, self.experts.up, self.experts.down):
                p.sequence_parallel = True
        # the step's statistics: per-expert assignments, then STATS; summed over training forwards
        self.register_buffer("stats", torch.zeros(cfg.moe.experts + len(STATS), dtype=torch.float64),
                             persistent=False)

    @property
    def output(self) -> None:  # Block's overlapped (Domino) path needs a row-parallel output: not here
        raise AssertionError("parallel.tp_overlap does not apply to mixture-of-experts layers")

    def forward(self, x: Tensor, entry: Optional[object] = None) -> Tensor:
        assert entry is None, "parallel.tp_overlap does not apply to mixture-of-experts layers"
        routed = x if self.sp else split_to_sequence(x, self.tp)
        y = self._routed(routed)
        if not self.sp:
            y = gather_to_whole(y, self.tp)
        y = self.dropout(y)
        if self.shared is not None:  # a SwiGLU, with its own dropout
            y = y + self.shared(x)
        return y

    def _routed(self, x: Tensor) -> Tensor:
        moe, E, k = self.moe, self.moe.experts, self.moe.top_k
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        logits = F.linear(flat, self.router.weight).float()
        idx, gates, probs = route(logits, moe, self.router.expert_bias)
        chosen = idx.reshape(-1)
        order = chosen.argsort(stable=True)  # copies sorted by expert, tokens in order within one
        counts = _count(chosen, E)
        dropped = None
        if moe.capacity_factor > 0:
            order, counts, dropped = self._drop(chosen, order, counts, b * s)
        token = order // k
        plan = plan_dispatch(counts, order.shape[0], self.ep,
                             self.experts.local)
        rows = dispatch(flat.index_select(0, token), plan, self.ep)
        out = self.experts(rows, plan.per_expert)
        back = combine(out, plan, self.ep)
        weighted = back * gates.reshape(-1).index_select(0, order).unsqueeze(1).to(back.dtype)
        y = torch.zeros_like(flat).index_add_(0, token, weighted).view(b, s, h)
        aux = self._balance(logits, idx, probs, b, s, counts, dropped)
        if aux is not None and self.par.aux_weight.value:
            y = _AttachLoss.apply(y, aux, self.par.aux_weight.value)
        return y

    def _drop(self, chosen: Tensor, order: Tensor, counts: Tensor, tokens: int) -> tuple[Tensor, Tensor, Tensor]:
        """Capacity: each expert takes its first capacity_factor·tokens·k/E copies of this rank's microbatch (in
        token order, GShard's policy); the rest are dropped (their gate's share is lost). Depends on the
        layout (the microbatch and rank a token is routed from): outside the parity guarantee."""
        E, k = self.moe.experts, self.moe.top_k
        capacity = math.ceil(self.moe.capacity_factor * tokens * k / E)
        starts = counts.cumsum(0) - counts
        position = torch.arange(order.numel(), device=order.device) - starts[chosen[order]]
        keep = position < capacity
        kept = counts.clamp(max=capacity)
        return order[keep], kept, (counts - kept).sum()

    def _balance(self, logits: Tensor, idx: Tensor, probs: Tensor, b: int, s: int, counts: Tensor,
                 dropped: Optional[Tensor]) -> Optional[Tensor]:
        """The weighted auxiliary losses of this rank's tokens (a sum over tokens; None if both are off), and
        the step's statistics, counted in training forwards only (not in evaluation nor in a recomputation)."""
        moe, E, k = self.moe, self.moe.experts, self.moe.top_k
        counting = torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1
        need = (moe.aux_loss > 0 or moe.z_loss > 0) and torch.is_grad_enabled()
        if not (counting or need):
            return None
        per_seq = torch.zeros(b, E, dtype=torch.float32, device=idx.device)
        per_seq.scatter_add_(1, idx.reshape(b, s * k), torch.ones(b, s * k, device=idx.device))
        if self.tp is not None:  # each tp rank holds a part of every sequence
            self.tp.all_reduce(per_seq, tag="router")
        if self.par.cp.size > 1:  # and so does each cp rank: f_e is the whole sequence's share
            self.par.cp.all_reduce(per_seq, tag="router")
        share = per_seq * (E / (self.seq_len * k))  # f_e·E: 1 for every expert under balanced routing
        # Without the losses, the statistics keep nothing for backward: a recomputation (which skips them)
        # must save what the first forward saved.
        with torch.set_grad_enabled(need):
            balance = (share.unsqueeze(1) * probs.view(b, s, E)).sum()  # Σ_t Σ_e f_e P_{t,e}: s·E·Σ f P
            z = logits.logsumexp(-1).square().sum()
        if counting:
            tail = torch.stack([balance.detach().double(), z.detach().double(),
                                (dropped if dropped is not None else counts.new_zeros(())).double(),
                                torch.tensor(float(b * s), dtype=torch.float64, device=idx.device)])
            self.stats.add_(torch.cat([_count(idx.reshape(-1), E).double(), tail]))
        if not need:
            return None
        return moe.aux_loss * balance + moe.z_loss * z

    @torch.no_grad()
    def after_step(self, totals: Tensor, update: bool) -> None:
        """The step's statistics summed over every rank (``totals``, this layer's row): move the selection bias
        (sigmoid) toward balanced load, bias_e += rate·sign(mean load - load_e); forget the step's counts."""
        bias = self.router.expert_bias
        if update and bias is not None and self.moe.bias_update_rate > 0:
            load = totals[:self.moe.experts]  # float64: loads past 2^24 copies compared exactly
            bias.add_((torch.sign(load.mean() - load) * self.moe.bias_update_rate).to(bias.dtype))
        self.stats.zero_()



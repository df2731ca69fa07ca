"""Plan a run without running it: what each rank holds, keeps and computes (``pretrain.py --dry-run``).

Ranks with the same (pp_rank, tp_rank) hold the same: dp replicas are copies,
cp ranks hold equal parts of every sequence and tp splits every tensor evenly,
so one row per pipeline stage describes the whole grid. This module assembles each stage's row from its parts:

- parameters: the real model class built on meta (megazero.plan.params);
- model state and ZeRO's buffers: Rajbhandari et al. SC'20 (megazero.plan.state_bytes);
- activations: Korthikanti et al. 2022, §4, over the schedule's peak (megazero.plan.activations);
- a mixture of experts' dispatch buffers, kept rows and all-to-all bytes (megazero.plan.dispatch); its
  routed experts' states sharded over edp = dp / ep (megazero.plan.state_bytes);
- context parallelism: every per-microbatch figure at a cp rank's s/cp tokens, the bytes its attention sends
  over cp (megazero.plan.context), model states sharded over dp x cp (megazero.plan.state_bytes);
- FLOPs and stage costs: ``megazero.costs``, the one formula behind throughput and MFU (active parameters).

It reads a resolved config (megazero.config.resolve) and resolves nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megazero.config.schema import Config
from megazero.costs import (compute_device, head_flops_per_token, layers_flops_per_token, model_flops_per_token,
                            pipeline_costs, plan_attention_share)
from megazero.plan.activations import (LOGIT_BYTES, activation_bytes_per_layer, activation_peak,
                                      attention_mask_bytes, peak_microbatches, pipeline_bubble)
from megazero.plan.context import local_seq_len, sent_bytes, ulysses_kept_bytes
from megazero.plan.dispatch import DispatchBytes, all_to_all_bytes, dispatch_bytes, moe_layer_activation_bytes
from megazero.plan.memo import PlanMemo
from megazero.plan.optimizer_step import OptimizerStep
from megazero.plan.params import ModelCounts, ParamCounts
from megazero.plan.state_bytes import gathered_bytes, grad_buffer_bytes, rank_state_bytes
from megazero.models import arch
from megazero.parallel.balance import balance_layers, rank_costs
from megazero.parallel.pipeline import partition_layers
from megazero.parallel.schedules import Action, virtual_stage
from megazero.parallel.dims import ParallelDims
from megazero.parallel.zero.registry import OPTIMIZERS

GB = 1e9


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: what each of its tp*dp*cp ranks holds, keeps and computes."""

    pp_rank: int
    ranks: range  # global ranks of the stage (every dp replica, cp and tp rank): contiguous, tp fastest, then cp, dp
    layers: list[range]  # per model chunk
    params: int  # held by one rank, the tied embedding copy on the last stage included
    replicated: int  # of those, the ones every tp rank holds whole
    model_state: dict[str, int]
    act_ckpt: int  # bytes with activation checkpointing, peak over the schedule
    act_full: int  # bytes without it
    in_flight: int  # peak microbatches (virtual, for interleaved) held at once
    logits: int  # bytes of fp32 logits included in both activation figures
    flops: float  # model FLOPs per step of one rank of this stage
    gathered: int = 0  # ZeRO-3: peak bytes of whole parameters gathered during the step
    grad_buffers: int = 0  # ZeRO-2/3: bucket gradient buffers alive beside the shard (filling and in flight)
    experts: int = 0  # of ``params``, the routed experts' (E/ep per mixture-of-experts layer), sharded over edp
    expert_state: dict = None  # their part of ``model_state``
    moe_layers: int = 0  # mixture-of-experts layers on the stage
    dispatch: int = 0  # bytes: one such layer's dispatch buffers beyond what it keeps (its forward's working set)
    all_to_all: int = 0  # bytes sent to other ep ranks per step
    context: int = 0  # bytes sent to other cp ranks per step (megazero.plan.context)
    # the optimizer's exchanges and FLOPs beyond the update, as its registry row counts them (Muon's: plan.muon)
    optimizer_step: OptimizerStep = OptimizerStep.none()


@dataclass(frozen=True)
class StageBalance:
    """Each pipeline rank's work as parallel.balance weighs it (megazero.costs.pipeline_costs), for this
    config's layer counts per virtual stage and for those ``parallel.pp_layers: auto`` gives."""

    counts: list[int]
    rank_costs: list[float]
    auto_counts: list[int]
    auto_rank_costs: list[float]

    @classmethod
    def of(cls, cfg: Config, ranges: list[range], memo: Optional[PlanMemo] = None) -> "StageBalance":
        par = cfg.parallel
        memo = memo or PlanMemo(remember=False)
        costs = pipeline_costs(cfg.model, par.tp, cfg.train.precision, compute_device(cfg.launch.device))
        counts = [len(r) for r in ranges]
        auto = memo.call(balance_layers, cfg.model.layers, par.pp, costs, par.virtual_stages)
        return cls(counts, rank_costs(counts, par.pp, costs), auto, rank_costs(auto, par.pp, costs))


@dataclass(frozen=True)
class Plan:
    cfg: Config
    world_size: int
    stages: list[StagePlan]
    total_params: int
    flops_per_step: float  # whole model, whole global batch (active parameters)
    tokens_per_step: int
    microbatches: int
    bubble: float
    balance: StageBalance
    active_params: int = 0  # a token's: top_k routed experts per mixture-of-experts layer, not E
    dispatch: DispatchBytes = DispatchBytes(0, 0, 0, 0, 0)  # one mixture-of-experts layer and microbatch, per rank


def logit_bytes(cfg: Config, tokens: int, width: int) -> int:
    """The last stage's logits of one microbatch's ``tokens`` over ``width`` vocabulary rows: the fp32 softmax the
    loss keeps for backward; chunked (``train.loss_chunk_tokens``), one chunk's logits while it is computed, fp32
    and the matmul's dtype, and nothing kept (parallel/head_loss.py): the bound the memory tracker checks."""
    chunk = cfg.train.loss_chunk_tokens
    if not chunk:
        return tokens * width * LOGIT_BYTES
    return min(tokens, chunk) * width * (LOGIT_BYTES + (0 if cfg.train.precision == "fp32" else 2))

def _stage_plan(cfg: Config, r: int, ranges: list[range], sched: list[Action], params: ParamCounts,
                memo: PlanMemo) -> StagePlan:
    m, par, t = cfg.model, cfg.parallel, cfg.train
    v, last_vs = par.virtual_stages, par.pp * par.virtual_stages - 1
    chunks = [virtual_stage(r, c, par.pp) for c in range(v)]
    counts = [params.chunk_counts(ranges[vs], vs == 0, vs == last_vs) for vs in chunks]
    psi, replicated, experts = (sum(c[i] for c in counts) for i in range(3))
    state, expert_state = rank_state_bytes(cfg, psi, experts)
    sp = par.sequence_parallel and par.tp > 1
    moe_in = {vs: arch.moe_layer_count(m, ranges[vs]) for vs in chunks}
    seq = local_seq_len(cfg)  # a cp rank's part of every sequence

    kept_mask, mask = attention_mask_bytes(cfg)  # a document mask: what a layer keeps of it, and its temporary

    def layer(recompute: bool) -> int:
        return memo.call(activation_bytes_per_layer, seq, t.micro_batch, m.hidden, m.heads, par.tp, sp,
                         recompute, flash=True, precision=t.precision, ffn=m.ffn_hidden, kv_heads=m.kv_head_count,
                         swiglu=m.spec.gated_mlp, head_dim=m.head_width) + ulysses_kept_bytes(cfg, recompute) \
            + (0 if recompute else kept_mask)

    mixtures = {rec: moe_layer_activation_bytes(cfg, rec) + ulysses_kept_bytes(cfg, rec) if any(moe_in.values())
                else 0 for rec in (False, True)}

    def mixture(recompute: bool) -> int:
        return mixtures[recompute]

    def layers(vs: int, n: int, recompute: bool) -> int:
        """The first n layers of chunk vs (recomputed or not): its dense layers and mixtures of experts."""
        moe = arch.moe_layer_count(m, range(ranges[vs].start, ranges[vs].start + n))
        return (n - moe) * layer(recompute) + moe * mixture(recompute)

    def largest(vs: int) -> int:  # the layer being recomputed holds its full set meanwhile: the larger kind
        return max(layer(False) if len(ranges[vs]) > moe_in[vs] else 0, mixture(False) if moe_in[vs] else 0)

    logits = logit_bytes(cfg, t.micro_batch * seq, m.padded_vocab // par.tp)
    # kept per microbatch in flight until its backward; chunked, nothing is kept and one chunk's logits exist
    # while the loss or its backward runs: added once to the peaks below
    chunked = bool(t.loss_chunk_tokens) and last_vs in chunks
    head = [logits if vs == last_vs and not chunked else 0 for vs in chunks]
    def recomputed(vs: int) -> int:  # model.checkpoint_layers: the first k layers of each chunk (0: all)
        return min(m.checkpoint_layers, len(ranges[vs])) if m.checkpoint_layers else len(ranges[vs])

    ckpt, count = memo.peak(activation_peak, sched, [
        layers(vs, recomputed(vs), True) + (layers(vs, len(ranges[vs]), False) - layers(vs, recomputed(vs), False)) + h
        for vs, h in zip(chunks, head)])
    full, _ = memo.peak(activation_peak, sched, [layers(vs, len(ranges[vs]), False) + h for vs, h in zip(chunks, head)])
    # the one layer being recomputed in backward holds its full set meanwhile; when a chunk keeps some layers'
    # full activations (checkpoint_layers), those are freed by the time its first layers are recomputed
    if any(recomputed(vs) == len(ranges[vs]) for vs in chunks):
        ckpt += max(largest(vs) for vs in chunks if recomputed(vs) == len(ranges[vs]))
    if chunked:
        ckpt, full = ckpt + logits, full + logits
    ckpt, full = ckpt + mask, full + mask  # one attention call's, while it runs
    moe_layers = sum(moe_in[vs] for vs in chunks)
    tokens = t.global_batch * m.seq_len // (par.dp * par.cp)  # this (dp, cp) rank's share
    per_token = sum(layers_flops_per_token(m, ranges[vs], attention_share=plan_attention_share(cfg)) for vs in chunks)
    per_token += head_flops_per_token(m) if last_vs in chunks else 0
    flops = per_token * tokens / par.tp
    moe_recomputed = sum(arch.moe_layer_count(m, range(ranges[vs].start, ranges[vs].start + recomputed(vs)))
                         for vs in chunks) if m.activation_checkpointing else 0
    all_recomputed = sum(recomputed(vs) for vs in chunks) if m.activation_checkpointing else 0
    # a range, not a list: a search plans hundreds of layouts of up to a million ranks each
    dims = ParallelDims.of(par)
    first, last = dims.rank(r), dims.rank(r, par.dp - 1, par.cp - 1, par.tp - 1)
    assert last - first + 1 == par.tp * par.dp * par.cp, (first, last, par.tp, par.dp, par.cp)  # contiguous
    return StagePlan(r, range(first, last + 1), [ranges[vs] for vs in chunks], psi, replicated, state, ckpt, full,
                     count, logits if last_vs in chunks else 0, flops, gathered_bytes(cfg, chunks, ranges, psi, params),
                     grad_buffer_bytes(cfg, chunks, ranges, psi, params, experts), experts, expert_state,
                     moe_layers, dispatch_bytes(cfg).transient if moe_layers else 0,
                     all_to_all_bytes(cfg, moe_layers, moe_recomputed),
                     sent_bytes(cfg, sum(len(ranges[vs]) for vs in chunks), all_recomputed),
                     optimizer_step(cfg, [ranges[vs] for vs in chunks]))


def optimizer_step(cfg: Config, layers: list[range]) -> OptimizerStep:
    """What ``optim.name``'s registry row says its step adds for a stage holding ``layers``."""
    row = OPTIMIZERS[cfg.optim.name]
    return row.plan_step(cfg, layers) if row.plan_step is not None else OptimizerStep.none()


def make_plan(cfg: Config, memo: Optional[PlanMemo] = None) -> Plan:
    """The plan of a config whose world is resolved (megazero.config.resolve.resolve); ``memo`` remembers its
    costly parts across the plans of one layout search."""
    memo = memo or PlanMemo(remember=False)
    m, par, t = cfg.model, cfg.parallel, cfg.train
    mb = cfg.microbatches
    ranges = partition_layers(m.layers, par.pp * par.virtual_stages, par.pp_layers)
    # the schedule is walked for its activation peak only: the shortest one with the same peak
    schedule = memo.schedule(par.schedule, par.pp, peak_microbatches(par.schedule, par.pp, mb, par.virtual_stages),
                             par.virtual_stages)
    params = ParamCounts.of(cfg, memo)
    stages = [_stage_plan(cfg, r, ranges, schedule[r], params, memo) for r in range(par.pp)]
    tokens = t.global_batch * m.seq_len
    counts = ModelCounts.of(cfg)
    return Plan(cfg, par.tp * par.pp * par.dp * par.cp, stages, counts.total, model_flops_per_token(m, plan_attention_share(cfg)) * tokens,
                tokens, mb, pipeline_bubble(par.schedule, par.pp, mb, par.virtual_stages),
                StageBalance.of(cfg, ranges, memo), counts.active, dispatch_bytes(cfg))

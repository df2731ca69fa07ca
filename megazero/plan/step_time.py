"""Predicted step time of a layout on a described cluster: the layout planner's model (docs/planner.md).

A pure function of a resolved config, a :class:`~megazero.plan.cluster.Cluster` and a few fitted
:class:`Constants`. Its FLOPs and bytes come from the ``--dry-run`` plan and the one FLOPs formula
(megazero.plan.stage_plan, megazero.costs: per-stage FLOPs, parameters, activation and logit bytes, the schedule's
bubble), never from copies of them; the model adds only time. Per step, on the slowest pipeline stage:

* ``compute``: the stage's matmul FLOPs at the peak times an achieved efficiency
  ``e_max * x / (x + x_half)``, where ``x`` is a matmul's arithmetic intensity (``MKN / (MK + KN + MN)``,
  FLOPs per byte of its bf16 operands, with M = micro_batch * seq_len / cp tokens) over the GPU's ridge point
  (peak / HBM bandwidth): thin matmuls (small hidden / tp, a narrow head dimension) run further from peak;
  weighted over the layer's matmuls, the attention products and the output head by their FLOPs. A routed
  expert's matmuls have the rows that reach one expert, tokens/tp * top_k * ep / E under balanced routing;
* ``elementwise``: the memory-bound work between the matmuls (norms, GELU, dropout, residuals, softmax;
  the cross entropy over the logits): ``hbm_passes`` times the bytes of activations a layer keeps for
  backward (the plan's Korthikanti et al. count, with the s x s scores only when the modelled software
  materialises them) plus the plan's logit bytes, over the HBM bandwidth;
* ``recompute``: the recomputed layers' forward again, a third of their compute and elementwise time;
* ``tp_comm``: per layer and microbatch, 2 collectives forward and 2 backward (2 more for a recomputed
  forward) of ``b*s/cp*h`` bf16 values, a ring all-reduce (all-gather + reduce-scatter with sequence
  parallelism: the same bytes) on the tp group's links; ``parallel.tp_overlap`` hides ``tp_hidden`` of it.
  A mixture-of-experts layer has its attention's, and its MLP's only for shared experts or, without sequence
  parallelism, for the routed output gathered back (each tp rank routes its own part of the sequence);
* ``ep_comm``: a mixture of experts' all-to-alls, per layer and microbatch 2 forward and 2 backward (2 more
  recomputed) of the tokens x top_k rows of h bf16 values a rank routes, (ep - 1)/ep of them leaving it, on the
  ep group's links (ep ranks are adjacent within dp: ``tp * cp`` apart): the share for peers on the rank's node
  over NVLink, the rest through its adapter, the slower setting the time; on the critical path, not hidden;
* ``cp_comm``: context parallelism's traffic (megazero.plan.context): the ring's K/V (and backward dK/dV)
  transfers less what each step's block of attention hides, or Ulysses' all-to-alls, on the critical path;
* ``bubble``: the bottleneck stage's work stretched by the schedule's idle share (megazero.plan.stage_plan);
* ``p2p``: with ``parallel.overlap_p2p`` only the fill and drain transfers (2 (p-1)), else every one;
* ``dp_comm``: the gradients' reduction (all-reduce; reduce-scatter under ZeRO >= 1) behind the last
  microbatch's backward, the ZeRO-1/2 parameter all-gather behind the next step's first forward, ZeRO-3's
  per-layer gathers behind the compute they prefetch for; only what cannot hide is counted. A mixture of
  experts' routed experts reduce (and gather) over edp x cp (edp = dp / ep), the rest over dp x cp;
* ``optimizer``: memory-bound, ~32 bytes moved per parameter of the shard.

Placement (parallel.topology: tp fastest, then cp, dp, pp; megazero.plan.links): a group of ``size`` ranks
``stride`` apart that spans nodes runs at ``min(NVLink, members per node * InfiniBand)`` per GPU, since each of
a node's members drives its own adapter (rail-aligned rings); inside a node at NVLink speed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megazero.config.schema import Config
from megazero.costs import head_flops_per_token, layers_flops_per_token, model_shape, plan_attention_share
from megazero.plan.activations import activation_bytes_per_layer
from megazero.plan.cluster import Cluster
from megazero.plan.context import cp_seconds, local_seq_len
from megazero.plan.dispatch import moe_layer_activation_bytes
from megazero.plan.fits import stage_bytes
from megazero.plan.links import all_to_all, group_link, nested_link, ring
from megazero.plan.optimizer_step import FP32_SHARE
from megazero.plan.stage_plan import Plan, make_plan
from megazero.plan.state_bytes import grad_bytes_per_param
from megazero.models.arch import expert_hidden, ffn_hidden, moe_layer_count
from megazero.parallel.zero.policy import StagePolicy

ACT_BYTES = 2  # bf16 activations and parameters cross the links
OPTIMIZER_BYTES = 32  # per parameter of a shard: fp32 master, m, v read and written, the gradient read, bf16 out


@dataclass(frozen=True)
class Constants:
    """The model's free constants, each physically meaningful; fitted by bench/planner.py to the published
    rows (megazero.plan.published) by minimising the largest |log(predicted / published)|."""

    e_max: float = 0.8486  # the share of peak a matmul reaches when its intensity is far above the ridge point
    x_half: float = 3.434  # a matmul's intensity, in units of the GPU's ridge point, at which it reaches e_max / 2
    hbm_passes: float = 3.322  # HBM bytes moved by the memory-bound kernels per byte of activation a layer keeps
    comm_eff: float = 0.9245  # the share of a link's bandwidth a collective (or a p2p transfer) achieves
    tp_hidden: float = 1.0  # the share of tensor-parallel collectives parallel.tp_overlap hides
    # Not fitted: a description of the software modelled. megazero's attention (SDPA, the Triton kernel) never
    # keeps the s x s scores; Megatron-LM in 2021 (the A100 rows) did, and read and wrote them in HBM.
    materialised_scores: bool = False


@dataclass(frozen=True)
class StepTime:
    """Seconds per step, by term; ``total`` is what a step takes."""

    compute: float  # matmuls of the bottleneck stage, forward + backward
    recompute: float
    tp_comm: float  # the part not hidden
    bubble: float
    p2p: float
    dp_comm: float  # the part not hidden
    optimizer: float
    total: float
    memory_bytes: int  # the largest rank's planned bytes (megazero.plan.fits.stage_bytes of the plan)
    terms: dict = field(default_factory=dict)
    elementwise: float = 0.0  # memory-bound kernels of the bottleneck stage, forward + backward
    ep_comm: float = 0.0  # a mixture of experts' all-to-alls on the bottleneck stage
    cp_comm: float = 0.0  # context parallelism's K/V transfers (the part attention cannot hide) or all-to-alls


def _efficiency(c: Constants, intensity: float, ridge: float) -> float:
    x = intensity / ridge
    return c.e_max * x / (x + c.x_half)


def _intensity(m: float, k: float, n: float) -> float:
    """FLOPs per byte of an (M x K) @ (K x N) matmul reading both operands and writing the result once
    (2MKN FLOPs over 2(MK + KN + MN) bf16 bytes)."""
    return m * k * n / (m * k + k * n + m * n)


def _recomputed_share(cfg: Config, layers_per_chunk: int) -> float:
    m = cfg.model
    if not m.activation_checkpointing or layers_per_chunk == 0:
        return 0.0
    return min(m.checkpoint_layers, layers_per_chunk) / layers_per_chunk if m.checkpoint_layers else 1.0


def _flops_split(cfg: Config, chunks: list[range], head: bool) -> dict[str, float]:
    """Shares of a stage's FLOPs (the one formula, megazero.costs) in its weight matmuls, the attention
    score and value products, and the output head."""
    m = cfg.model
    weights = sum(layers_flops_per_token(m, r, seq_len=0) for r in chunks)
    attention = sum(layers_flops_per_token(m, r, attention_share=plan_attention_share(cfg)) for r in chunks) - weights
    out = head_flops_per_token(m) if head else 0.0
    total = weights + attention + out
    return {"weights": weights / total, "attention": attention / total, "head": out / total}


def _layer_matmuls(cfg: Config, tokens: float, moe: bool) -> list[tuple[float, float, float, float]]:
    """One layer's weight matmuls on a rank, (M, K, N, weight): an (M x K) @ (K x N) product, weighted by its
    FLOPs per token of the sequence. A dense layer's run on every token with their columns split over tp; a
    mixture of experts' router and routed experts on the 1/tp of the tokens a tp rank routes, each expert on the
    rows that reach it."""
    m, tp = cfg.model, cfg.parallel.tp
    h, f, kv = m.hidden, ffn_hidden(m), model_shape(m)["kv_hidden"]
    q, mlp = model_shape(m)["q_hidden"], model_shape(m)["mlp_matrices"]

    def swiglu(rows: float, width: float, split: float, weight: float) -> list:
        return [(rows, h, width / split, weight)] * (mlp - 1) + [(rows, width / split, h, weight)]

    attention = [(tokens, h, (q + 2 * kv) / tp, 1.0), (tokens, q / tp, h, 1.0)]
    if not moe:
        return attention + swiglu(tokens, f, tp, 1.0)
    e = m.moe
    fe = expert_hidden(m)
    per_expert = max(1.0, tokens / tp * e.top_k * cfg.parallel.ep / e.experts)
    out = attention + [(tokens / tp, h, e.experts, 1.0 / tp)] + swiglu(per_expert, fe, 1, e.top_k / tp)
    return out + (swiglu(tokens, e.shared_experts * fe, tp, 1.0) if e.shared_experts else [])


def _matmul_slowdown(cfg: Config, cluster: Cluster, c: Constants, chunks: list[range],
                     head: bool) -> tuple[float, float]:
    """(mean of 1/efficiency over a stage's FLOPs: its matmul time is flops * this / peak; the same over its
    layers' matmuls alone, at which the attention products run)."""
    m, tp = cfg.model, cfg.parallel.tp
    ridge = cluster.peak_tflops * 1e12 / (cluster.hbm_gbps * 1e9)
    # tp_overlap (Domino) runs each microbatch as two halves: each half's matmuls have half the rows
    tokens = cfg.train.micro_batch * local_seq_len(cfg) // (2 if cfg.parallel.tp_overlap and tp > 1 else 1)
    moe = sum(moe_layer_count(m, r) for r in chunks)
    kinds = [(n, mats) for n, mats in ((sum(len(r) for r in chunks) - moe, _layer_matmuls(cfg, tokens, False)),
                                       (moe, _layer_matmuls(cfg, tokens, True) if moe else [])) if n]
    # the mean over the stage's weight matmuls, each weighted by its FLOPs
    total = sum(n * k * nn * w for n, mats in kinds for _, k, nn, w in mats)
    slow_w = sum(n * k * nn * w / total / _efficiency(c, _intensity(rows, k, nn), ridge)
                 for n, mats in kinds for rows, k, nn, w in mats)
    # the attention products run as the layer's matmuls do; when the scores are materialised their HBM traffic
    # is in the elementwise term (the plan's 5as/h bytes), not here
    slow_a = slow_w
    slow_h = 1 / _efficiency(c, _intensity(tokens, m.hidden, m.padded_vocab / tp), ridge)
    share = _flops_split(cfg, chunks, head)
    return share["weights"] * slow_w + share["attention"] * slow_a + share["head"] * slow_h, slow_a


def _layer_activation_bytes(cfg: Config, c: Constants) -> int:
    """Bytes one layer keeps for backward per microbatch without recompute (megazero.plan.stage_plan's count): the
    tensors its memory-bound kernels write and read."""
    m, par = cfg.model, cfg.parallel
    return activation_bytes_per_layer(local_seq_len(cfg), cfg.train.micro_batch, m.hidden, m.heads, par.tp,
                                      par.sequence_parallel and par.tp > 1, False,
                                      flash=not c.materialised_scores, precision=cfg.train.precision,
                                      ffn=m.ffn_hidden, kv_heads=m.kv_head_count, swiglu=m.spec.gated_mlp,
                                      head_dim=m.head_width)


def _moe_tp_collectives(cfg: Config) -> int:
    """A mixture-of-experts layer's tp collectives per pass, where a dense layer has 2 (attention, MLP): its
    attention's; its shared experts'; without sequence parallelism its routed output gathered back."""
    p = cfg.parallel
    return 1 + (cfg.model.moe.shared_experts > 0) + (p.tp > 1 and not p.sequence_parallel)


def step_time(cfg: Config, cluster: Cluster, c: Constants = Constants(), plan: Optional[Plan] = None) -> StepTime:
    """The predicted step of a resolved config (megazero.config.resolve) on ``cluster``; ``plan``, when given, is
    ``make_plan(cfg)`` already made (a fit calls this many times per config)."""
    plan = make_plan(cfg) if plan is None else plan
    m, par, t, z = cfg.model, cfg.parallel, cfg.train, cfg.zero
    tp, pp, dp, cp = par.tp, par.pp, par.dp, par.cp
    peak = cluster.peak_tflops * 1e12
    hbm = cluster.hbm_gbps * 1e9
    mb = plan.microbatches  # per dp replica
    act = t.micro_batch * local_seq_len(cfg) * m.hidden * ACT_BYTES  # one microbatch's (a cp rank's part)
    layer_bytes = _layer_activation_bytes(cfg, c)
    moe_bytes = moe_layer_activation_bytes(cfg, False, flash=not c.materialised_scores) if m.moe.experts else 0
    tp_link = group_link(cluster, tp, 1)

    worst = None
    for s in plan.stages:
        layers = sum(len(r) for r in s.layers)
        dense = layers - s.moe_layers
        share = sum(_recomputed_share(cfg, len(r)) * len(r) for r in s.layers) / max(1, layers)
        slowdown, layer_slowdown = _matmul_slowdown(cfg, cluster, c, s.layers, s.logits > 0)
        compute = s.flops * slowdown / peak
        kept = dense * layer_bytes + s.moe_layers * moe_bytes
        elementwise = c.hbm_passes * (kept + s.logits) * mb / hbm
        split = _flops_split(cfg, s.layers, s.logits > 0)
        head_share = split["head"]
        layer_time = compute * (1 - head_share) + c.hbm_passes * kept * mb / hbm
        recompute = share * layer_time / 3  # the forward again: a third of forward + backward
        collectives = layers * (4 + 2 * share) if not s.moe_layers else \
            (2 * dense + _moe_tp_collectives(cfg) * s.moe_layers) * (2 + share)
        tp_comm = ring(collectives * mb * act, tp, tp_link, c, passes=2.0)
        if par.tp_overlap:
            tp_comm *= 1 - c.tp_hidden
        # the plan's bytes leaving this rank per step; ep ranks are adjacent within dp, tp * cp apart
        ep_comm = all_to_all(cluster, s.all_to_all, s.moe_layers * mb * (4 + 2 * share), par.ep, tp * cp, c)
        attention = s.flops * split["attention"] * layer_slowdown / peak / max(1, layers * mb)  # a layer's
        cp_comm = layers * mb * cp_seconds(cfg, cluster, c, attention, share)
        work = compute + elementwise + recompute + tp_comm + ep_comm + cp_comm
        if worst is None or work > worst["work"]:
            worst = dict(work=work, compute=compute, elementwise=elementwise, recompute=recompute,
                         tp_comm=tp_comm, ep_comm=ep_comm, cp_comm=cp_comm, stage=s)
    work, s = worst["work"], worst["stage"]
    stretched = work / (1 - plan.bubble) if plan.bubble < 1 else float("inf")
    bubble = stretched - work

    # pipeline transfers: one microbatch's activations (1/tp of them with sequence parallelism)
    p2p_bytes = act / (tp if par.sequence_parallel else 1)
    crosses = tp * cp * dp * pp > cluster.gpus_per_node  # some stage boundary crosses nodes: one GPU's adapter
    bandwidth, latency = cluster.link(crosses)
    one = p2p_bytes / (bandwidth * c.comm_eff) + latency
    hops = 2 * (pp - 1) if par.overlap_p2p else 2 * mb * par.virtual_stages
    p2p = 0.0 if pp == 1 else hops * one

    # data parallelism: this rank's gradients and ZeRO's gathers against what hides them, over dp x cp (the cp
    # ranks see other tokens of the same samples: dp * cp ranks tp apart); the routed experts' over edp x cp
    # (cp ranks tp apart, edp ranks tp * cp * ep apart)
    dp_link, grads = group_link(cluster, dp * cp, tp), dp * cp
    edp, experts = dp // par.ep, (s.experts if par.ep > 1 else 0)
    edp_link = nested_link(cluster, cp, tp, edp, tp * cp * par.ep)
    params = s.params - experts
    forward = (worst["compute"] + worst["elementwise"]) / 3 / mb  # one microbatch's forward
    backward = work / mb - forward  # one microbatch's backward (its recompute and tp collectives included)
    policy = StagePolicy.of(z.stage)
    # ZeRO-0 all-reduces whole gradients; a sharded optimizer reduce-scatters them and gathers the parameters
    passes = 1.0 if policy.shard_optimizer else 2.0
    reduce = ring(params * _grad_bytes(cfg), grads, dp_link, c, passes=passes)
    gather = ring(params * ACT_BYTES, grads, dp_link, c, passes=1.0) if policy.shard_optimizer else 0.0
    if experts:
        reduce += ring(experts * _grad_bytes(cfg), edp * cp, edp_link, c, passes=passes)
        gather += ring(experts * ACT_BYTES, edp * cp, edp_link, c, passes=1.0) if policy.shard_optimizer else 0.0
    gather_hide = forward  # ZeRO-1/2: the updated parameters gathered behind the next first forward
    if policy.shard_params:  # each layer gathered before its forward and its backward, prefetched behind the previous
        gathers = 2 * mb if z.reshard_after_forward else 1
        gather *= gathers
        gather_hide = work if z.reshard_after_forward else forward
    dp_comm = max(0.0, reduce - backward) + max(0.0, gather - gather_hide)
    shard = -(-params // grads) + -(-experts // (edp * cp)) if policy.shard_optimizer else params + experts
    optimizer = shard * OPTIMIZER_BYTES / hbm
    extra = s.optimizer_step  # the optimizer's own exchanges over the stage's ranks and its fp32 FLOPs (Muon's)
    if extra.calls:
        optimizer += all_to_all(cluster, extra.sent, extra.calls, tp * cp * dp, 1, c)
    optimizer += extra.flops / (peak * FP32_SHARE)
    total = stretched + p2p + dp_comm + optimizer
    memory = max(stage_bytes(cfg, st, "cuda") for st in plan.stages)
    return StepTime(worst["compute"], worst["recompute"], worst["tp_comm"], bubble, p2p, dp_comm, optimizer,
                    total, memory,
                    {"dp_reduce": reduce, "dp_gather": gather, "dp_hideable": backward, "p2p_one": one,
                     "efficiency": s.flops / peak / worst["compute"] if worst["compute"] else 0.0,
                     "bubble_share": plan.bubble, "stage": s.pp_rank, "ep_comm": worst["ep_comm"],
                     "cp_comm": worst["cp_comm"]},
                    worst["elementwise"], worst["ep_comm"], worst["cp_comm"])


def _grad_bytes(cfg: Config) -> int:
    return grad_bytes_per_param(cfg.train.precision, cfg.zero.grad_dtype)

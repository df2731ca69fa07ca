"""Predicted step time of a layout on a described cluster: the layout planner's model (docs/planner.md).

A pure function of a resolved config, a :class:`~megazero.cluster.Cluster`
and a few fitted :class:`Constants`. It takes its FLOPs and bytes from the
``--dry-run`` plan (megazero.plan: per-stage FLOPs, parameters, model states,
activations, the schedule's bubble), never from copies of those formulas, and
adds time:

* compute: the stage's FLOPs (recompute included) at the peak times an
  achieved efficiency that falls for thin matmuls: ``e_max * x / (x + x_half)``
  with ``x = hidden / tp`` (a rank's matmul width);
* tensor parallelism: per layer and microbatch, 2 collectives forward and 2
  backward (2 more for a recomputed forward) of ``b*s*h`` bf16 values, a ring
  all-reduce (all-gather + reduce-scatter with sequence parallelism: the same
  bytes) on the tp group's links; ``parallel.tp_overlap`` hides
  ``tp_hidden`` of it;
* the pipeline: the bottleneck stage's work stretched by the schedule's bubble
  (``(p-1)/(m+p-1)`` for 1F1B; interleaving and zb1p as megazero.plan), plus
  the p2p transfers of the fill and drain;
* data parallelism: the gradients' reduction (and ZeRO's parameter gathers)
  over the dp group's links, of which the last microbatch's backward hides
  what it can (megazero reduces buckets as that backward produces them);
  ZeRO-3 adds the forward and backward gathers, hidden behind their layers'
  compute up to the bucket in flight;
* the optimizer step: memory-bound, ~32 bytes moved per parameter shard;
* placement: a group shares a node when its ranks fit in one (tp is the
  fastest-varying coordinate, then dp, then pp: megazero.topology).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megazero.cluster import Cluster
from megazero.config import Config
from megazero.fits import stage_bytes

ACT_BYTES = 2  # bf16 activations cross the links
OPTIMIZER_BYTES = 32  # per parameter of a shard: fp32 master, m, v read and written, the gradient read, bf16 out


@dataclass(frozen=True)
class Constants:
    """The model's free constants, each physically meaningful; fitted by bench/planner.py."""

    e_max: float = 0.62  # the largest share of peak a transformer layer's matmuls reach
    x_half: float = 600.0  # the matmul width (hidden / tp) at which they reach half of e_max
    comm_eff: float = 0.7  # the share of a link's bandwidth a ring collective achieves
    tp_hidden: float = 0.75  # the share of tensor-parallel collectives tp_overlap hides (Domino: 3 of 4)


@dataclass(frozen=True)
class StepTime:
    """Seconds per step, by term; ``total`` is what a step takes."""

    compute: float
    recompute: float
    tp_comm: float
    bubble: float
    p2p: float
    dp_comm: float
    optimizer: float
    total: float
    memory_bytes: int  # the largest rank's planned bytes
    terms: dict = field(default_factory=dict)


def _efficiency(c: Constants, width: float) -> float:
    return c.e_max * width / (width + c.x_half)


def _ring(nbytes: float, n: int, link: tuple[float, float], c: Constants, passes: float = 2.0) -> float:
    """A ring collective over n ranks: passes*(n-1)/n of the bytes over the slowest link, plus its hops."""
    if n <= 1:
        return 0.0
    bandwidth, latency = link
    return passes * (n - 1) / n * nbytes / (bandwidth * c.comm_eff) + passes * (n - 1) * latency


def _recomputed_share(cfg: Config, layers_per_chunk: int) -> float:
    m = cfg.model
    if not m.activation_checkpointing:
        return 0.0
    return min(m.checkpoint_layers, layers_per_chunk) / layers_per_chunk if m.checkpoint_layers else 1.0


def step_time(cfg: Config, cluster: Cluster, c: Constants = Constants()) -> StepTime:
    """The predicted step of a resolved config (megazero.config.resolve_world) on ``cluster``."""
    from megazero.plan import make_plan

    plan = make_plan(cfg)
    m, par, t, z = cfg.model, cfg.parallel, cfg.train, cfg.zero
    tp, pp, dp, v = par.tp, par.pp, par.dp, par.virtual_stages
    node = cluster.gpus_per_node
    tp_link = cluster.link(tp > node)
    dp_link = cluster.link(tp * dp > node)
    pp_link = cluster.link(tp * dp * pp > node and tp * dp >= node)
    peak = cluster.peak_tflops * 1e12 * _efficiency(c, m.hidden / tp)
    mb = plan.microbatches  # per dp replica
    act = t.micro_batch * m.seq_len * m.hidden * ACT_BYTES

    worst, stage_terms = None, []
    for s in plan.stages:
        layers = sum(len(r) for r in s.layers)
        per_chunk = max(1, layers // max(1, len(s.layers)))
        share = _recomputed_share(cfg, per_chunk)
        layer_flops = s.flops if not s.logits else s.flops * _layer_fraction(cfg, layers)
        compute = s.flops / peak
        recompute = share * layer_flops / 3 / peak  # the forward again: a third of forward + backward
        tp_bytes = layers * mb * (4 + 2 * share) * act
        tp_comm = _ring(tp_bytes, tp, tp_link, c, passes=2.0)
        if par.tp_overlap:
            tp_comm *= 1 - c.tp_hidden
        work = compute + recompute + tp_comm
        stage_terms.append((work, compute, recompute, tp_comm, s))
        if worst is None or work > worst[0]:
            worst = stage_terms[-1]
    work, compute, recompute, tp_comm, s = worst
    stretched = work / (1 - plan.bubble) if plan.bubble < 1 else float("inf")
    bubble = stretched - work
    p2p_bytes = act / (tp if par.sequence_parallel else 1)
    p2p = 0.0 if pp == 1 else 2 * (pp - 1) * _ring(p2p_bytes, 2, pp_link, c, passes=1.0)

    # data parallelism: the reduction of this rank's gradients (and ZeRO's gathers) against what hides it
    params = s.params
    grad_bytes = params * _grad_bytes(cfg)
    if z.stage == 0:
        dp_time = _ring(grad_bytes, dp, dp_link, c, passes=2.0)
    else:  # reduce-scatter the gradients, all-gather the parameters
        dp_time = _ring(grad_bytes, dp, dp_link, c, passes=1.0) + _ring(params * ACT_BYTES, dp, dp_link, c, 1.0)
    hideable = (compute + recompute + tp_comm) / mb * 2 / 3  # the last microbatch's backward
    if z.stage == 3:  # gathers in forward and backward: each layer's behind the layer before
        dp_time += 2 * _ring(params * ACT_BYTES, dp, dp_link, c, passes=1.0)
        hideable += (compute + recompute + tp_comm) / mb * 1 / 3 * mb
    dp_comm = max(0.0, dp_time - hideable)
    shard = params / (dp if z.stage >= 1 else 1)
    optimizer = shard * OPTIMIZER_BYTES / (cluster.hbm_gbps * 1e9)
    total = stretched + p2p + dp_comm + optimizer
    memory = max(stage_bytes(cfg, st, "cuda") for st in plan.stages)
    return StepTime(compute, recompute, tp_comm, bubble, p2p, dp_comm, optimizer, total, memory,
                    {"dp_total": dp_time, "dp_hideable": hideable, "efficiency": peak / (cluster.peak_tflops * 1e12)})


def _grad_bytes(cfg: Config) -> int:
    from megazero.plan import grad_bytes_per_param

    return grad_bytes_per_param(cfg.train.precision, cfg.zero.grad_dtype)


def _layer_fraction(cfg: Config, layers: int) -> float:
    """The share of a last stage's FLOPs in its layers (the rest is the head)."""
    from megazero.metrics import flops_per_token, model_shape

    m = cfg.model
    shape = model_shape(m)
    body = flops_per_token(layers, m.hidden, m.ffn_hidden, m.seq_len, 0, **shape)
    whole = flops_per_token(layers, m.hidden, m.ffn_hidden, m.seq_len, m.padded_vocab, **shape)
    return body / whole

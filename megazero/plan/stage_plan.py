"""Plan a run without running it: what each rank holds, keeps and computes (``pretrain.py --dry-run``).

Ranks with the same (pp_rank, tp_rank) hold the same: dp replicas are copies,
and tp splits every tensor evenly, so one row per pipeline stage describes the
whole grid. Each stage's model chunks are built on the meta device — the real
module code, so the parameter counts cannot drift from the model — and no
memory is allocated, no process group is started and no data is read.

Sources of the estimates:

- model state: ZeRO, Rajbhandari et al. SC'20, §3 and Figure 1, the (2+2+K)Ψ
  family generalised to the dtypes megazero uses (:func:`model_state_bytes`);
- activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in
  Large Transformer Models", §4, Eq. (1)-(5) (:func:`activation_bytes_per_layer`);
- FLOPs: ``megazero.train.metrics``, the one formula behind throughput and MFU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Sequence

import torch

from megazero.config.schema import AUTO, Config
from megazero.train.metrics import flops_per_token, model_flops_per_token, model_shape
from megazero.plan.memo import PlanMemo
from megazero.config.rules import compute_device, pipeline_costs
from models.build import count_parameters
from models.llama import kv_replicas_needed
from models.stage import GPT
from parallel.balance import balance_layers, rank_costs
from parallel.comm import Comm
from parallel.pipeline import partition_layers
from parallel.schedules import Action, virtual_stage
from parallel.topology import coords_to_rank
from parallel.zero.grads import grad_precision

BYTES_PER_VALUE = {"fp32": 4, "bf16": 2, "fp16": 2}
ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32
MASTER_BYTES = 4  # fp32 master copy when the model is kept in 16 bits
LOGIT_BYTES = 4  # the cross entropy keeps a float32 softmax of this rank's vocabulary slice
GB = 1e9


def optimizer_bytes_per_param(precision: str) -> int:
    """K of the ZeRO paper: Adam's two fp32 moments, plus an fp32 master copy under 16-bit training."""
    b = BYTES_PER_VALUE[precision]
    return ADAM_STATE_BYTES + (MASTER_BYTES if b != 4 else 0)


def grad_bytes_per_param(precision: str, grad_dtype: str = "auto") -> int:
    """Bytes of one gradient element as ZeRO accumulates it (``zero.grad_dtype``: fp32 under bf16 by default)."""
    return BYTES_PER_VALUE[grad_precision(precision, grad_dtype)]


def model_state_bytes(psi: int, stage: int, dp: int, precision: str, offload_optimizer: str = "none",
                      offload_params: str = "none", grad_dtype: str = "auto") -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state one rank keeps, by ZeRO stage.

    Rajbhandari et al. SC'20, §3 / Figure 1: (2+2+K)Ψ without partitioning;
    stage 1 partitions the optimizer state over dp, stage 2 also the gradients,
    stage 3 also the parameters. Here b = 4 (fp32) or 2 (bf16/fp16) bytes per
    parameter and gradient (gradients: 4 when accumulated in fp32, ``zero.grad_dtype``; the paper's fp16
    gradients are 2), K = 8 (+4 master) bytes. A partition is
    ceil(Ψ/dp) elements: the implementation pads the flat buffer to a multiple
    of dp. Offloaded kinds count in ``cpu_total`` instead of ``device_total``, with the offloaded
    optimizer's pinned gradient buffer (g bytes per element of its range); the per-kind keys give the
    size wherever it lives.
    """
    if stage not in (0, 1, 2, 3) or dp < 1 or psi < 0:
        raise ValueError(f"stage={stage}, dp={dp}, psi={psi}: need stage 0..3, dp >= 1, psi >= 0")
    if offload_params == "cpu" and stage != 3:
        raise ValueError(f"offload_params=cpu needs stage 3 (got {stage})")
    b, k = BYTES_PER_VALUE[precision], optimizer_bytes_per_param(precision)
    g = grad_bytes_per_param(precision, grad_dtype)
    shard = -(-psi // dp)
    params = psi * b if stage < 3 else shard * b
    grads = psi * g if stage < 2 else shard * g
    optimizer = k * psi if stage == 0 else k * shard
    # offloaded optimizer: its states and a pinned landing buffer for the gradients of its range
    staging = g * (psi if stage == 0 else shard) if offload_optimizer == "cpu" else 0
    cpu = (optimizer + staging if offload_optimizer == "cpu" else 0) + (params if offload_params == "cpu" else 0)
    return {"params": params, "grads": grads, "optimizer": optimizer,
            "device_total": params + grads + optimizer - (cpu - staging), "cpu_total": cpu}


def activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                               sequence_parallel: bool = False, recompute: bool = False, flash: bool = True,
                               precision: str = "bf16", ffn: int | None = None, kv_heads: int | None = None,
                               swiglu: bool = False) -> int:
    """Activation bytes one transformer layer keeps for backward, per microbatch.

    Korthikanti et al. 2022, §4, Eq. (1)-(5), 16-bit activations:
    no parallelism sbh(34 + 5as/h); tensor parallel sbh(10 + 24/t + 5as/(ht));
    tensor + sequence parallel sbh(34/t + 5as/(ht)); full recomputation keeps
    only the layer input, 2sbh (2sbh/t with sequence parallelism). The 5as/h
    term is the materialised s×s attention scores, softmax and dropout mask;
    flash-style attention (torch SDPA, kernels.attention) stores none of them,
    so ``flash=True`` drops it. fp32 activations (train.precision fp32) double
    every term.

    The 24 split over tp is q, k, v and the attention output (8) and the MLP's
    2·sbf twice (16 at ffn = 4h). The same count for a Llama block: k and v are
    kv_heads/heads of q's size (each k/v head on tp/kv_heads ranks when fewer),
    and SwiGLU keeps four ffn-wide tensors (gate and up outputs, silu(gate), the
    product), 8·sbf; norms, block inputs and dropout masks are as GPT-2's 10.
    """
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    f = 4 * h if ffn is None else ffn
    kv = a if kv_heads is None else kv_heads
    sbh = s * b * h
    if recompute:
        per = Fraction(2 * sbh, t if sequence_parallel else 1)
    else:
        split = 4 + Fraction(4 * kv, a * min(kv, t)) * t + Fraction((8 if swiglu else 4) * f, h)  # then / t
        core = (10 + split) / t if sequence_parallel else 10 + split / t
        scores = 0 if flash else Fraction(5 * a * s, h * t)
        per = sbh * (core + scores)
    return math.ceil(per * (2 if precision == "fp32" else 1))


def activation_peak(actions: Sequence[Action], per_microbatch: Sequence[int]) -> tuple[int, int]:
    """(peak bytes, peak count) of microbatches in flight along one rank's schedule.

    A forward of chunk c adds ``per_microbatch[c]`` until its backward frees it
    (zb1p: its weight gradient W; the input gradient B keeps the graph for it);
    the peak over the action order is what the rank must hold (1F1B: at most
    min(pp - r, m) microbatches, Narayanan et al. 2021; GPipe: all m; zb1p:
    min(pp, m) on every rank). Not counted: the output gradients zb1p's B
    records for W.
    """
    ends = "W" if any(a.kind == "W" for a in actions) else "B"
    held = count = peak_bytes = peak_count = 0
    for a in actions:
        if a.kind == "F":
            held, count = held + per_microbatch[a.chunk], count + 1
            peak_bytes, peak_count = max(peak_bytes, held), max(peak_count, count)
        elif a.kind == ends:
            held, count = held - per_microbatch[a.chunk], count - 1
    return peak_bytes, peak_count


def pipeline_bubble(schedule: str, pp: int, m: int, v: int = 1) -> float:
    """Idle fraction of a step: (p-1)/(m+p-1), and (p-1)/(v·m+p-1) interleaved (Narayanan et al. 2021);
    zb1p with equal F, B and W costs: (p-1)/(3m+p-1) (ZB-H1 idles (p-1)(F+B-W), Qi et al. 2023, §3.1)."""
    if schedule == "zb1p":
        return (pp - 1) / (3 * m + pp - 1)
    chunks = v if schedule == "interleaved" else 1
    return (pp - 1) / (chunks * m + pp - 1)


def planned_world_size(cfg: Config, launcher_world: int) -> int:
    """parallel.world_size when set; else the launcher's when launched (a dry run under torchrun or srun checks
    the config against the world it would get); else tp*pp*dp when dp is explicit; else 1."""
    p = cfg.parallel
    if p.world_size > 0:
        return p.world_size
    if p.dp != AUTO and launcher_world == 1:
        return p.tp * p.pp * p.dp
    return launcher_world


def _planning_comm(tp: int, name: str = "tp") -> Comm:
    """A Comm that claims rank 0 of a group of the given size, with no process group behind it."""
    comm = Comm(None, name)
    comm.rank, comm.size = 0, tp
    return comm


def _built_parameters(cfg: Config, layer_ids: range, first: bool, last: bool) -> tuple[int, int]:
    """(held, replicated over tp) parameter counts of a model chunk on one tp rank, built on meta."""
    with torch.device("meta"):
        model = GPT(cfg.model, tp=_planning_comm(cfg.parallel.tp), layer_ids=layer_ids, first_stage=first,
                    last_stage=last, sequence_parallel=cfg.parallel.sequence_parallel,
                    kv_replicas=_planning_comm(kv_replicas_needed(cfg.model, cfg.parallel.tp), "kv"))
    held = sum(p.numel() for p in model.parameters())
    replicated = sum(p.numel() for p in model.parameters() if p.tp_split_dim is None)
    return held, replicated


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts on one tp rank, from the real model class built on meta once per kind: a chunk's ends
    (embeddings, final norm, head; by first/last stage) and one transformer layer. Every layer holds the same
    parameters, so a chunk of n layers is its ends plus n times one layer, and a plan takes the same time at
    10 layers as at 10^9, and at 2 stages as at 10^6."""

    ends: dict  # (first, last) -> (held, replicated)
    layer: tuple[int, int]

    @classmethod
    def of(cls, cfg: Config, memo: Optional[PlanMemo] = None) -> "ParamCounts":
        memo = memo or PlanMemo(remember=False)

        def built(layer_ids: range, first: bool, last: bool) -> tuple[int, int]:
            key = (repr(cfg.model), cfg.parallel.tp, cfg.parallel.sequence_parallel, layer_ids, first, last)
            return memo.call(_built_parameters, cfg, layer_ids, first, last, key=key)

        ends = {(first, last): built(range(0), first, last) for first in (False, True) for last in (False, True)}
        one = built(range(1), False, False)
        bare = ends[(False, False)]
        return cls(ends, (one[0] - bare[0], one[1] - bare[1]))

    def chunk(self, layers: int, first: bool, last: bool) -> tuple[int, int]:
        held, replicated = self.ends[(first, last)]
        return held + layers * self.layer[0], replicated + layers * self.layer[1]


def chunk_parameters(cfg: Config, layer_ids: range, first: bool, last: bool) -> tuple[int, int]:
    """(held, replicated over tp) parameter counts of one model chunk on one tp rank (see ParamCounts)."""
    return ParamCounts.of(cfg).chunk(len(layer_ids), first, last)


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: what each of its tp*dp ranks holds, keeps and computes."""

    pp_rank: int
    ranks: list[int]  # global ranks of the stage (every dp replica, every tp rank)
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


@dataclass(frozen=True)
class StageBalance:
    """Each pipeline rank's work as parallel.balance weighs it (megazero.config.rules.pipeline_costs), for this
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
    flops_per_step: float  # whole model, whole global batch
    tokens_per_step: int
    microbatches: int
    bubble: float
    balance: StageBalance


def _stage_plan(cfg: Config, r: int, ranges: list[range], sched: list[Action], params: ParamCounts,
                memo: PlanMemo) -> StagePlan:
    m, par, t, z = cfg.model, cfg.parallel, cfg.train, cfg.zero
    v, last_vs = par.virtual_stages, par.pp * par.virtual_stages - 1
    chunks = [virtual_stage(r, c, par.pp) for c in range(v)]
    counts = [params.chunk(len(ranges[vs]), vs == 0, vs == last_vs) for vs in chunks]
    psi, replicated = sum(c[0] for c in counts), sum(c[1] for c in counts)
    state = model_state_bytes(psi, z.stage, par.dp, t.precision, z.offload_optimizer, z.offload_params,
                              z.grad_dtype)
    sp = par.sequence_parallel and par.tp > 1

    def layer(recompute: bool) -> int:
        return memo.call(activation_bytes_per_layer, m.seq_len, t.micro_batch, m.hidden, m.heads, par.tp, sp,
                         recompute, flash=True, precision=t.precision, ffn=m.ffn_hidden, kv_heads=m.kv_head_count,
                         swiglu=m.arch == "llama")

    logits = t.micro_batch * m.seq_len * (m.padded_vocab // par.tp) * LOGIT_BYTES
    head = [logits if vs == last_vs else 0 for vs in chunks]
    def recomputed(vs: int) -> int:  # model.checkpoint_layers: the first k layers of each chunk (0: all)
        return min(m.checkpoint_layers, len(ranges[vs])) if m.checkpoint_layers else len(ranges[vs])

    ckpt, count = memo.peak(activation_peak, sched, [recomputed(vs) * layer(True) + (len(ranges[vs]) - recomputed(vs))
                                          * layer(False) + h for vs, h in zip(chunks, head)])
    full, _ = memo.peak(activation_peak, sched, [len(ranges[vs]) * layer(False) + h for vs, h in zip(chunks, head)])
    # the one layer being recomputed in backward holds its full set meanwhile; when a chunk keeps some layers'
    # full activations (checkpoint_layers), those are freed by the time its first layers are recomputed
    if any(recomputed(vs) == len(ranges[vs]) for vs in chunks):
        ckpt += layer(False)
    n_layers = sum(len(ranges[vs]) for vs in chunks)
    tokens = t.global_batch * m.seq_len // par.dp  # this dp replica's share
    vocab = m.padded_vocab if last_vs in chunks else 0
    per_token = flops_per_token(n_layers, m.hidden, m.ffn_hidden, m.seq_len, vocab, **model_shape(m))
    flops = per_token * tokens / par.tp
    ranks = [coords_to_rank(r, d, k, par.tp, par.dp) for d in range(par.dp) for k in range(par.tp)]
    return StagePlan(r, sorted(ranks), [ranges[vs] for vs in chunks], psi, replicated, state, ckpt, full,
                     count, max(head), flops, _gathered(cfg, chunks, ranges, psi, params),
                     _grad_buffers(cfg, chunks, psi, params))


GRAD_BUFFERS = 3  # ZeroOptimizer's default: two reductions in flight and the bucket filling


def _grad_buffers(cfg: Config, chunks: list[int], psi: int, params: ParamCounts) -> int:
    """ZeRO-2/3's whole-bucket gradient buffers beside the shard: at most three alive (two reductions in flight
    and one filling, parallel.zero.grads), each a bucket — ``zero.bucket_mb``, or one parameter larger than
    that (stage 2), or a layer or a chunk's root (stage 3, which buckets by layer). Stages 0-1 keep whole
    buffers, counted in the model state."""
    z, m, p = cfg.zero, cfg.model, cfg.parallel
    if z.stage < 2:
        return 0
    g = grad_bytes_per_param(cfg.train.precision, z.grad_dtype)
    last_vs = p.pp * p.virtual_stages - 1
    if z.stage == 3:
        largest = max([params.layer[0]] + [params.ends[(vs == 0, vs == last_vs)][0] for vs in chunks])
    else:
        h, f, t = m.hidden, m.ffn_hidden, p.tp
        largest = max(f * h, (h if m.arch == "llama" else 3 * h) * h) // t  # MLP, or fused qkv / q
        if any(vs in (0, last_vs) for vs in chunks):
            largest = max(largest, m.padded_vocab // t * h)
        largest = max(largest, int(z.bucket_mb * 2 ** 20) // g)
    largest = min(largest, psi)  # no bucket holds more than the stage
    buffers = min(GRAD_BUFFERS, -(-psi // largest)) if largest else 0
    return buffers * -(-largest // p.dp) * p.dp * g


def _gathered(cfg: Config, chunks: list[int], ranges: list[range], psi: int, params: ParamCounts) -> int:
    """ZeRO-3's whole parameters held during a step: the root buckets (embeddings, final norm) and two layers
    (one in use, one prefetched) when layers are freed after forward; every layer of the stage when
    ``zero.reshard_after_forward`` is false (the default under a pipeline)."""
    if cfg.zero.stage != 3:
        return 0
    last_vs = cfg.parallel.pp * cfg.parallel.virtual_stages - 1
    root = sum(params.ends[(vs == 0, vs == last_vs)][0] for vs in chunks)
    layers = sum(len(ranges[vs]) for vs in chunks)
    b = BYTES_PER_VALUE[cfg.train.precision]
    if not cfg.zero.reshard_after_forward or layers <= 2:
        return psi * b
    return (root + 2 * -(-(psi - root) // layers)) * b


def make_plan(cfg: Config, memo: Optional[PlanMemo] = None) -> Plan:
    """The plan of a config whose world is resolved (megazero.config.load.resolve_world); ``memo`` remembers its
    costly parts across the plans of one layout search."""
    memo = memo or PlanMemo(remember=False)
    m, par, t = cfg.model, cfg.parallel, cfg.train
    mb = cfg.microbatches
    ranges = partition_layers(m.layers, par.pp * par.virtual_stages, par.pp_layers)
    schedule = memo.schedule(par.schedule, par.pp, mb, par.virtual_stages)
    params = ParamCounts.of(cfg, memo)
    stages = [_stage_plan(cfg, r, ranges, schedule[r], params, memo) for r in range(par.pp)]
    tokens = t.global_batch * m.seq_len
    return Plan(cfg, par.tp * par.pp * par.dp, stages, count_parameters(m), model_flops_per_token(m) * tokens,
                tokens, mb, pipeline_bubble(par.schedule, par.pp, mb, par.virtual_stages),
                StageBalance.of(cfg, ranges, memo))

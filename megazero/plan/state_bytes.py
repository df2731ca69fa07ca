"""What one rank keeps of the model state, and ZeRO's whole-size buffers beside it, in bytes.

Model state: ZeRO, Rajbhandari et al. SC'20, §3 and Figure 1, the (2+2+K)Ψ family generalised to the dtypes
megazero uses (:func:`model_state_bytes`). What each stage shards is parallel.zero's StagePolicy, read by
name. Pure arithmetic; megazero.plan.stage_plan assembles the per-stage figures.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from megazero.config.schema import Config
from megazero.parallel.zero.grads import grad_precision
from megazero.models.arch import expert_hidden, moe_layer_count
from megazero.parallel.zero.policy import StagePolicy
from megazero.parallel.zero.registry import OPTIMIZERS

if TYPE_CHECKING:
    from megazero.plan.params import ParamCounts

BYTES_PER_VALUE = {"fp32": 4, "bf16": 2, "fp16": 2}
ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32
MASTER_BYTES = 4  # fp32 master copy when the model is kept in 16 bits
ZERO_STAGES = (0, 1, 2, 3)


def optimizer_bytes_per_param(precision: str) -> int:
    """K of the ZeRO paper: Adam's two fp32 moments, plus an fp32 master copy under 16-bit training."""
    b = BYTES_PER_VALUE[precision]
    return ADAM_STATE_BYTES + (MASTER_BYTES if b != 4 else 0)


def grad_bytes_per_param(precision: str, grad_dtype: str = "auto") -> int:
    """Bytes of one gradient element as ZeRO accumulates it (``zero.grad_dtype``: fp32 under bf16 by default)."""
    return BYTES_PER_VALUE[grad_precision(precision, grad_dtype)]


def model_state_bytes(psi: int, stage: int, dp: int, precision: str, offload_optimizer: str = "none",
                      offload_params: str = "none", grad_dtype: str = "auto",
                      optimizer_states: Optional[Callable[[int, int, bool], int]] = None,
                      nvme_buffer_bytes: int = 0, master_apart: bool = False) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state one rank keeps, by ZeRO stage.

    Rajbhandari et al. SC'20, §3 / Figure 1: (2+2+K)Ψ without partitioning;
    stage 1 partitions the optimizer state over dp, stage 2 also the gradients,
    stage 3 also the parameters. Here b = 4 (fp32) or 2 (bf16/fp16) bytes per
    parameter and gradient (gradients: 4 when accumulated in fp32, ``zero.grad_dtype``; the paper's fp16
    gradients are 2), K = 8 (+4 master) bytes. A partition is
    ceil(Ψ/dp) elements: the implementation pads the flat buffer to a multiple
    of dp. Offloaded kinds count in ``cpu_total`` instead of ``device_total``, with the offloaded
    optimizer's pinned gradient buffer (g bytes per element of its range); the per-kind keys give the
    size wherever it lives. ``optimizer_states``: the optimizer's registry row's ``state_bytes`` where its
    states are not Adam's two moments (1-bit Adam keeps its momentum and error whole on every rank);
    ``master_apart``: it keeps an fp32 master even where the parameters are fp32 (0/1 Adam past its freeze). On a
    local disk (``offload_optimizer="nvme"``, ZeRO-Infinity) the states count in ``nvme_total``, and the host
    holds the buffers that stream them (``nvme_buffer_bytes``) beside the gradients' landing buffer; stage 3's
    shards there too (``offload_params="nvme"``) count in ``nvme_total`` (the host holds a few layers' in flight).
    """
    if stage not in ZERO_STAGES or dp < 1 or psi < 0:
        raise ValueError(f"stage={stage}, dp={dp}, psi={psi}: need stage 0..3, dp >= 1, psi >= 0")
    policy = StagePolicy.of(stage)
    if offload_params != "none" and not policy.shard_params:
        raise ValueError(f"offload_params={offload_params} needs stage 3 (got {stage})")
    b, k = BYTES_PER_VALUE[precision], optimizer_bytes_per_param(precision)
    g = grad_bytes_per_param(precision, grad_dtype)
    shard = -(-psi // dp)
    params = shard * b if policy.shard_params else psi * b
    grads = shard * g if policy.shard_grads else psi * g
    optimizer = k * shard if policy.shard_optimizer else k * psi
    if optimizer_states is not None:  # the row's states, and the masters on the shard as above
        optimizer += optimizer_states(psi, dp, policy.shard_optimizer) - ADAM_STATE_BYTES * (
            shard if policy.shard_optimizer else psi)
    if master_apart and b == 4:
        optimizer += MASTER_BYTES * (shard if policy.shard_optimizer else psi)
    # offloaded optimizer: its states and a pinned landing buffer for the gradients of its range
    offloaded = offload_optimizer in ("cpu", "nvme")
    staging = g * (shard if policy.shard_optimizer else psi) if offloaded else 0
    # on the host: the states, or the buffers that stream them (no larger than the states: parallel.zero.nvme_adamw)
    held = {"none": 0, "cpu": optimizer, "nvme": min(nvme_buffer_bytes, optimizer)}[offload_optimizer]
    cpu = held + staging + (params if offload_params == "cpu" else 0)
    on_device = params + grads + (0 if offloaded else optimizer) - (params if offload_params != "none" else 0)
    return {"params": params, "grads": grads, "optimizer": optimizer, "device_total": on_device, "cpu_total": cpu,
            "nvme_total": (optimizer if offload_optimizer == "nvme" else 0)
            + (params if offload_params == "nvme" else 0)}


def rank_state_bytes(cfg: Config, psi: int, experts: int) -> tuple[dict[str, int], dict[str, int]]:
    """(the model state one rank keeps, the routed experts' part of it): :func:`model_state_bytes` of the dense
    parameters over dp x cp and of the experts' over their expert-data-parallel group, edp x cp with edp =
    dp / ep, as ZeRO partitions them (parallel.zero: one partition per reduction group, the Grid's grad_comm
    and expert_grad_comm: cp ranks see different tokens of the same samples). At ep = 1 edp is dp and one
    partition holds both."""
    p, z, t = cfg.parallel, cfg.zero, cfg.train

    def state(n: int, group: int) -> dict[str, int]:
        return model_state_bytes(n, z.stage, group, t.precision, z.offload_optimizer, z.offload_params,
                                 z.grad_dtype, OPTIMIZERS[cfg.optim.name].state_bytes,
                                 int(z.nvme_buffer_mb * 2 ** 20) if n else 0, OPTIMIZERS[cfg.optim.name].master_apart)

    whole = state(psi, p.dp * p.cp)
    if p.ep == 1 or not experts:
        return whole, (state(experts, p.dp * p.cp) if experts else dict.fromkeys(whole, 0))
    dense, expert = state(psi - experts, p.dp * p.cp), state(experts, p.dp // p.ep * p.cp)
    return {k: dense[k] + expert[k] for k in dense}, expert


GRAD_BUFFERS = 3  # ZeroOptimizer's default: two reductions in flight and the bucket filling


def grad_buffer_bytes(cfg: Config, chunks: list[int], ranges: list[range], psi: int, params: ParamCounts,
                      experts: int = 0) -> int:
    """ZeRO-2/3's whole-bucket gradient buffers beside the shard: at most three alive (two reductions in flight
    and one filling, parallel.zero.grads), each a bucket — ``zero.bucket_mb``, or one parameter larger than
    that (stage 2), or a layer or a chunk's root (stage 3, which buckets by layer). Stages 0-1 keep whole
    buffers, counted in the model state. With ep > 1 the routed experts' ``experts`` parameters are a partition
    of their own (reduced over edp), with its own buffers: a stacked expert weight (E/ep x expert_hidden x h)
    is one parameter, a layer's experts one stage-3 bucket."""
    z, m, p = cfg.zero, cfg.model, cfg.parallel
    policy = StagePolicy.of(z.stage)
    if not policy.shard_grads:
        return 0
    g = grad_bytes_per_param(cfg.train.precision, z.grad_dtype)
    last_vs = p.pp * p.virtual_stages - 1
    apart = experts if p.ep > 1 else 0  # the experts' own partition
    moe_layers = sum(moe_layer_count(m, ranges[vs]) for vs in chunks)
    dense_layers = sum(len(ranges[vs]) for vs in chunks) - moe_layers
    if policy.shard_params:  # a bucket per layer and partition
        mixture = params.moe_layer[0] - (params.moe_layer[2] if apart else 0) if moe_layers else 0
        largest = max([params.layer[0] if dense_layers else 0, mixture]
                      + [params.ends[(vs == 0, vs == last_vs)][0] for vs in chunks])
        largest_expert = params.moe_layer[2]
    else:  # bucket_mb, or a larger parameter
        h, t = m.hidden, p.tp
        mlp = m.ffn_hidden * h if dense_layers else 0
        if moe_layers:
            fe = expert_hidden(m)
            mlp = max(mlp, m.moe.shared_experts * fe * h)
            if not apart:  # the stacked experts (not split over tp) share the dense buckets
                mlp = max(mlp, m.moe.experts * fe * h * t)
        largest = max(mlp, (3 * h if m.spec.fused_qkv else h) * h) // t  # MLP, or fused qkv / q
        if any(vs in (0, last_vs) for vs in chunks):
            largest = max(largest, m.padded_vocab // t * h)
        largest = max(largest, int(z.bucket_mb * 2 ** 20) // g)
        largest_expert = max(m.moe.experts // p.ep * expert_hidden(m) * h, int(z.bucket_mb * 2 ** 20) // g) \
            if apart else 0
    dense = psi - apart

    def buffers(n: int, biggest: int, group: int) -> int:
        biggest = min(biggest, n)  # no bucket holds more than the partition
        count = min(GRAD_BUFFERS, -(-n // biggest)) if biggest else 0
        return count * -(-biggest // group) * group * g

    out = buffers(dense, largest, p.dp * p.cp)  # padded to the partition's group, dp x cp
    if apart:
        out += buffers(apart, largest_expert, p.dp // p.ep * p.cp)
    return out


def gathered_bytes(cfg: Config, chunks: list[int], ranges: list[range], psi: int, params: ParamCounts) -> int:
    """ZeRO-3's whole parameters held during a step: the root buckets (embeddings, final norm) and two layers
    (one in use, one prefetched; the larger kind, where dense and mixture-of-experts layers mix) when layers are
    freed after forward; every layer of the stage when ``zero.reshard_after_forward`` is false (the default
    under a pipeline). A layer's routed experts are gathered over edp as its dense parameters are over dp."""
    if not StagePolicy.of(cfg.zero.stage).shard_params:
        return 0
    last_vs = cfg.parallel.pp * cfg.parallel.virtual_stages - 1
    root = sum(params.ends[(vs == 0, vs == last_vs)][0] for vs in chunks)
    layers = sum(len(ranges[vs]) for vs in chunks)
    b = BYTES_PER_VALUE[cfg.train.precision]
    if not cfg.zero.reshard_after_forward or layers <= 2:
        return psi * b
    largest = max(params.largest_layer(ranges[vs]) for vs in chunks)
    return (root + 2 * largest) * b

"""What one rank keeps of the model state, and ZeRO's whole-size buffers beside it, in bytes.

Model state: ZeRO, Rajbhandari et al. SC'20, §3 and Figure 1, the (2+2+K)Ψ family generalised to the dtypes
megazero uses (:func:`model_state_bytes`). What each stage shards is parallel.zero's StagePolicy, read by
name. Pure arithmetic; megazero.plan.stage_plan assembles the per-stage figures.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megazero.config.schema import Config
from parallel.zero.grads import grad_precision
from parallel.zero.policy import StagePolicy

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
    if stage not in ZERO_STAGES or dp < 1 or psi < 0:
        raise ValueError(f"stage={stage}, dp={dp}, psi={psi}: need stage 0..3, dp >= 1, psi >= 0")
    policy = StagePolicy.of(stage)
    if offload_params == "cpu" and not policy.shard_params:
        raise ValueError(f"offload_params=cpu needs stage 3 (got {stage})")
    b, k = BYTES_PER_VALUE[precision], optimizer_bytes_per_param(precision)
    g = grad_bytes_per_param(precision, grad_dtype)
    shard = -(-psi // dp)
    params = shard * b if policy.shard_params else psi * b
    grads = shard * g if policy.shard_grads else psi * g
    optimizer = k * shard if policy.shard_optimizer else k * psi
    # offloaded optimizer: its states and a pinned landing buffer for the gradients of its range
    staging = g * (shard if policy.shard_optimizer else psi) if offload_optimizer == "cpu" else 0
    cpu = (optimizer + staging if offload_optimizer == "cpu" else 0) + (params if offload_params == "cpu" else 0)
    return {"params": params, "grads": grads, "optimizer": optimizer,
            "device_total": params + grads + optimizer - (cpu - staging), "cpu_total": cpu}


GRAD_BUFFERS = 3  # ZeroOptimizer's default: two reductions in flight and the bucket filling


def grad_buffer_bytes(cfg: Config, chunks: list[int], psi: int, params: ParamCounts) -> int:
    """ZeRO-2/3's whole-bucket gradient buffers beside the shard: at most three alive (two reductions in flight
    and one filling, parallel.zero.grads), each a bucket — ``zero.bucket_mb``, or one parameter larger than
    that (stage 2), or a layer or a chunk's root (stage 3, which buckets by layer). Stages 0-1 keep whole
    buffers, counted in the model state."""
    z, m, p = cfg.zero, cfg.model, cfg.parallel
    policy = StagePolicy.of(z.stage)
    if not policy.shard_grads:
        return 0
    g = grad_bytes_per_param(cfg.train.precision, z.grad_dtype)
    last_vs = p.pp * p.virtual_stages - 1
    if policy.shard_params:
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


def gathered_bytes(cfg: Config, chunks: list[int], ranges: list[range], psi: int, params: ParamCounts) -> int:
    """ZeRO-3's whole parameters held during a step: the root buckets (embeddings, final norm) and two layers
    (one in use, one prefetched) when layers are freed after forward; every layer of the stage when
    ``zero.reshard_after_forward`` is false (the default under a pipeline)."""
    if not StagePolicy.of(cfg.zero.stage).shard_params:
        return 0
    last_vs = cfg.parallel.pp * cfg.parallel.virtual_stages - 1
    root = sum(params.ends[(vs == 0, vs == last_vs)][0] for vs in chunks)
    layers = sum(len(ranges[vs]) for vs in chunks)
    b = BYTES_PER_VALUE[cfg.train.precision]
    if not cfg.zero.reshard_after_forward or layers <= 2:
        return psi * b
    return (root + 2 * -(-(psi - root) // layers)) * b

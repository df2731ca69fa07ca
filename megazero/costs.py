"""The one home of what a step computes: the FLOPs formula and the pipeline stage-cost model.

The metrics logger (throughput, MFU), the config's resolution (``parallel.pp_layers: auto``), the
``--dry-run`` plan, the step-time model and the benchmarks all read these functions, so a FLOP is counted
the same way everywhere. Pure arithmetic on a model config: no torch, nothing allocated.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megazero.models import arch
from megazero.models.config import ModelConfig
from megazero.parallel.balance import StageCosts

if TYPE_CHECKING:
    from megazero.config.schema import Config

# Memory-bound work as FLOPs-equivalents: the FLOPs a GPU would have done in the time it moves the bytes, its
# dense peak over its memory bandwidth (H200: 989 TFLOP/s bf16, 67 fp32, over 4.8 TB/s; an H100's 3.35 TB/s
# gives 295 / 20). The same bytes weigh 15x more beside 16-bit matmuls than beside fp32 ones.
FLOPS_PER_BYTE_16BIT = 200.0
FLOPS_PER_BYTE_FP32 = 14.0
# On a CPU core (fp32): ~90 GFLOP/s in a layer's matmuls against the cross entropy's ~4.3 ns per logit
# (40 bytes) measured on the 2-core development machine: ~10 FLOPs per byte.
FLOPS_PER_BYTE_CPU = 10.0
# The vocab-parallel cross entropy (parallel.tensor) reads or writes each fp32 logit of this rank's slice ten
# times: forward max, subtract (2), exp (2), sum, normalise (2); backward scale (2). The first pass is 16-bit
# casts under bf16, a little more: not counted.
CROSS_ENTROPY_BYTES_PER_LOGIT = 40
# The embedding lookup gathers a row (read, write) and its backward adds the gradient into it (read, write):
# four fp32 passes over hidden values per token, on every tp rank (the vocabulary is split, the rows are not).
EMBEDDING_BYTES_PER_VALUE = 16
# A layer's elementwise work, per token, in activation values read or written: two norms (forward 2h, backward
# 3h each) and two residual adds (forward 3h, backward 2h each), 20h; the MLP's activation function, forward 2
# and backward 3 passes over each of its ffn-wide inputs (GELU: one, SwiGLU: gate and up). Small beside a
# layer's matmuls at large h (it grows with h, they with h^2), a tenth of them at h = 256.
LAYER_PASSES_PER_HIDDEN = 20
LAYER_PASSES_PER_MLP_INPUT = 5


def flops_per_token(layers: int, hidden: int, ffn_hidden: int, seq_len: int, vocab: int,
                    kv_hidden: int | None = None, mlp_matrices: int = 2, q_hidden: int | None = None,
                    router: int = 0) -> float:
    """Training FLOPs per token (forward + backward, no recomputation).

    6 FLOPs per matmul parameter per token (2 forward, 4 backward) plus the
    attention score and value products, 12·L·s·q (PaLM, Chowdhery et al. 2022,
    App. B; q = heads·head_dim, h for the models here). Matmul parameters per layer: the q and output
    projections (2·h·q), k and v (2·h·kv_hidden: h·h each for multi-head attention, kv_heads·head_dim
    columns under grouped-query attention), the MLP (mlp_matrices·h·ffn: 2 for
    GPT-2's fc1/fc2, 3 for SwiGLU's gate/up/down; a mixture of experts' ffn is the width one token passes
    through, :func:`moe_active_ffn`) and a mixture of experts' router (h·router, its E experts);
    and the output head (V·h). The layout does not change it.
    """
    kv = hidden if kv_hidden is None else kv_hidden
    q = hidden if q_hidden is None else q_hidden
    matmul_params = layers * (2 * hidden * q + 2 * hidden * kv + mlp_matrices * hidden * ffn_hidden
                              + router * hidden) + vocab * hidden
    return 6.0 * matmul_params + 12.0 * layers * seq_len * q


def model_shape(model_cfg: ModelConfig) -> dict:
    """The keyword arguments of :func:`flops_per_token` that depend on the architecture."""
    m = model_cfg
    d = arch.head_dim(m)
    return {"kv_hidden": m.kv_head_count * d, "mlp_matrices": m.spec.mlp_matrices, "q_hidden": m.heads * d}


def moe_active_ffn(model_cfg: ModelConfig) -> int:
    """The SwiGLU width one token passes through in a mixture-of-experts layer: its top_k routed experts and the
    shared ones, (top_k + shared_experts) · expert_hidden. Only these count in FLOPs and MFU (active parameters),
    not the E - top_k experts a token skips."""
    m = model_cfg
    return (m.moe.top_k + m.moe.shared_experts) * arch.expert_hidden(m)


def layers_flops_per_token(model_cfg: ModelConfig, layer_ids: range, seq_len: int | None = None,
                           attention_share: float = 1.0) -> float:
    """Training FLOPs per token of these layers (no head): the dense ones at the model's ffn width, the
    mixtures of experts at their active width plus their router (``seq_len``: the attention products' length,
    0 for the weight matmuls alone; ``attention_share``: the share of causal attention a document mask leaves,
    :func:`expected_document_share`)."""
    m = model_cfg
    s = (m.seq_len if seq_len is None else seq_len) * attention_share
    moe_layers = arch.moe_layer_count(m, layer_ids)
    shape = model_shape(m)
    out = flops_per_token(len(layer_ids) - moe_layers, m.hidden, arch.ffn_hidden(m), s, 0, **shape)
    if moe_layers:
        out += flops_per_token(moe_layers, m.hidden, moe_active_ffn(m), s, 0, router=m.moe.experts, **shape)
    return out


def head_flops_per_token(model_cfg: ModelConfig) -> float:
    """Training FLOPs per token of the output head (V·h)."""
    m = model_cfg
    return flops_per_token(0, m.hidden, arch.ffn_hidden(m), m.seq_len, m.padded_vocab, **model_shape(m))


def model_flops_per_token(model_cfg: ModelConfig, attention_share: float = 1.0) -> float:
    """The whole model's training FLOPs per token (every layer and the head), as throughput and MFU count: active
    parameters only under a mixture of experts; the attention scaled by ``attention_share`` (document masks)."""
    m = model_cfg
    return layers_flops_per_token(m, range(m.layers), attention_share=attention_share) + head_flops_per_token(m)


def expected_document_share(document_tokens: int, seq_len: int) -> float:
    """The share of causal attention a document mask leaves in samples of ``seq_len`` tokens cut from a stream of
    documents of L = ``document_tokens`` tokens at a random offset: a query j tokens into the sample sees
    min(j, u) + 1 keys, u its place in its document, uniform over 0..L-1. Summed over the s queries and
    divided by the s(s+1)/2 causal entries: (L+1)(s - (L-1)/3) / (s(s+1)) for L <= s; for L > s the kept
    entries are s(s-1)/2 - (s-1)s(s+1)/(6L) + s. For documents of varying length, L is the length-weighted
    mean (sum l^2 / sum l: the length of a token's document, on average), which is what sets the share.
    1 without an estimate (0)."""
    s, n = seq_len, document_tokens
    if n <= 0:
        return 1.0
    if n <= s:
        kept = (n + 1) * (3 * s - n + 1) / 6
    else:  # every query's document may reach past the sample's start
        kept = s * (s - 1) / 2 - (s - 1) * s * (s + 1) / (6 * n) + s
    return kept / (s * (s + 1) / 2)


def plan_attention_share(cfg: Config) -> float:
    """:func:`expected_document_share` of a config: data.document_tokens under data.document_mask, else 1."""
    d = cfg.data
    return expected_document_share(d.document_tokens, cfg.model.seq_len) if d.document_mask else 1.0


def attention_flops_per_token(model_cfg: ModelConfig) -> float:
    """The attention score and value products' part of :func:`model_flops_per_token`, 12·L·s·q: what document
    masking scales down (:func:`parallel.sequence.document_mask_share`)."""
    m = model_cfg
    return layers_flops_per_token(m, range(m.layers)) - layers_flops_per_token(m, range(m.layers), seq_len=0)


def pipeline_costs(m: ModelConfig, tp: int = 1, precision: str = "fp32", device: str = "cuda") -> StageCosts:
    """What one rank computes per token (parallel.balance): a transformer layer and the output head from the
    FLOPs formula, plus as FLOPs-equivalents of their memory traffic the layer's elementwise work, the cross
    entropy over this rank's V/tp logits and the embedding lookup. ``m``: a model config (auto keys resolved
    or not); ``device``: cuda or cpu, whose matmuls outpace memory differently. Recomputation
    (model.activation_checkpointing) is not counted, as in the plan's FLOPs. With mixtures of experts among
    dense layers the layer is their mean (the balance weighs every layer alike); a mixture's routed tokens are
    split over tp as its attention's columns are, so both divide by tp."""
    if device == "cpu":
        per_byte = FLOPS_PER_BYTE_CPU
    else:
        per_byte = FLOPS_PER_BYTE_FP32 if precision == "fp32" else FLOPS_PER_BYTE_16BIT
    value_bytes = 4 if precision == "fp32" else 2
    mlp_inputs = m.spec.mlp_inputs

    def layer_cost(ffn: int, router: int) -> float:
        matmuls = flops_per_token(1, m.hidden, ffn, m.seq_len, 0, router=router, **model_shape(m)) / tp
        elementwise = (LAYER_PASSES_PER_HIDDEN * m.hidden + LAYER_PASSES_PER_MLP_INPUT * mlp_inputs * ffn / tp)
        return matmuls + elementwise * value_bytes * per_byte

    layer = layer_cost(arch.ffn_hidden(m), 0)
    moe_layers = arch.moe_layer_count(m, range(m.layers))
    if moe_layers:
        mixture = layer_cost(moe_active_ffn(m), m.moe.experts)
        layer = mixture if moe_layers == m.layers else ((m.layers - moe_layers) * layer + moe_layers * mixture) \
            / m.layers
    head = head_flops_per_token(m) / tp
    loss = CROSS_ENTROPY_BYTES_PER_LOGIT * per_byte * m.padded_vocab / tp
    return StageCosts(layer, EMBEDDING_BYTES_PER_VALUE * per_byte * m.hidden, head + loss)


def compute_device(launch_device: str) -> str:
    """launch.device as the cost model sees it: auto weighs memory traffic as a GPU does, whatever machine
    plans the run (a --dry-run on a login node plans the GPU run), and without touching CUDA."""
    return "cpu" if launch_device == "cpu" else "cuda"

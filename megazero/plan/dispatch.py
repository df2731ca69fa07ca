"""What a mixture-of-experts layer adds to a plan: its dispatch buffers, what it keeps for backward, and the bytes
its all-to-alls carry (``models.moe``, ``parallel.experts``).

Per rank and microbatch a mixture-of-experts layer routes its tp rank's part of its cp rank's tokens,
T = micro_batch * seq_len / (tp * cp) tokens, as R = T * top_k token copies ("rows"). Dropless and unpadded,
every buffer of the dispatch is R rows wide, whatever E: under perfectly balanced routing (what a plan assumes,
as ``--simulate`` does) a rank sends R rows and receives R. In the order the forward makes them (B bytes per
activation value):

- per row, the expert it chose, its place in the expert order and its token (int64 each, 24 bytes; with
  several experts per rank under ep > 1 also the received rows' expert order and its inverse, 16 more);
- the input copies (R x h, gathered from the tokens); with ep > 1 sent by the first all-to-all, received
  (R x h) and, with several experts per rank, put in expert order (R x h);
- the expert intermediates, four R x expert_hidden tensors (gate and up projections, silu(gate) and the
  product) that the grouped matmuls keep for backward, and the experts' outputs (R x h); with ep > 1 put
  back in the received order (R x h) and returned by the second all-to-all (R x h);
- the gate weight of each row (fp32, then B bytes) and the weighted outputs (R x h), summed into the tokens.

Backward keeps the experts' input rows, the four intermediates, the (returned) outputs, the weighted outputs,
the indices and the gates: R((3h + 4f)B + 24 + B) bytes (+16R with reordering). The forward peaks as the
weighted outputs are made: that, the fp32 gates, and with ep > 1 the experts' own outputs (R x h), not yet
freed. Measured against the running layer in tests/plan/test_dispatch_memory.py.

The all-to-alls: two in forward (dispatch, combine) and two in backward, each of R rows of h values,
(ep - 1)/ep of them to other ranks; a recomputed layer runs its two forward ones again.
"""
from __future__ import annotations

from dataclasses import dataclass

from megazero.config.schema import Config
from megazero.plan.activations import activation_bytes_per_layer
from megazero.plan.context import local_seq_len
from megazero.models.arch import expert_hidden

INDEX_BYTES = 8  # int64 token and sort indices per row
FP32 = 4


@dataclass(frozen=True)
class DispatchBytes:
    """One mixture-of-experts layer on one rank, per microbatch, in bytes (``rows`` in token copies)."""

    rows: int  # R = tokens * top_k routed by this rank
    peak: int  # the dispatch buffers at their peak in the layer's forward
    saved: int  # of those, kept for backward (counted in the layer's activations)
    router: int  # the router's tensors kept for backward (T x E probabilities, the gate values; its input)
    all_to_all: int  # sent to other ranks by one of the layer's all-to-alls

    @property
    def transient(self) -> int:
        """The dispatch buffers beyond what the layer keeps: the working set of one layer's forward."""
        return self.peak - self.saved


def value_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def dispatch_bytes(cfg: Config) -> DispatchBytes:
    """The dispatch buffers of one mixture-of-experts layer and microbatch on one rank (the module's list),
    under balanced routing; zeros for a dense model."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    moe = m.moe
    if not moe.experts:
        return DispatchBytes(0, 0, 0, 0, 0)
    b = value_bytes(t.precision)
    h, f, ep = m.hidden, expert_hidden(m), p.ep
    tokens = t.micro_batch * local_seq_len(cfg) // p.tp
    rows = tokens * moe.top_k
    reordered = ep > 1 and moe.experts // ep > 1  # received rows put in expert order, and back
    index = INDEX_BYTES * (3 + (2 if reordered else 0))
    kept = (3 * h + 4 * f) * b + index + b
    beyond = FP32 + (h * b if ep > 1 else 0)  # the fp32 gates; the experts' outputs before they were returned
    # the router keeps its fp32 probabilities (and logits, for an auxiliary loss; the sigmoid's normalised
    # affinities too), the top-k gate values and their sums; without sequence parallelism at tp > 1 also this
    # rank's part of the sequence, copied out for it
    need = moe.aux_loss > 0 or moe.z_loss > 0
    per_token = FP32 * (moe.experts * (1 + need + (need and moe.router == "sigmoid")) + moe.top_k + 2)
    router = tokens * (per_token + (h * b if p.tp > 1 and not p.sequence_parallel else 0))
    return DispatchBytes(rows, rows * (kept + beyond), rows * kept, router, rows * (ep - 1) // ep * h * b)


def all_to_all_bytes(cfg: Config, moe_layers: int, recomputed: int) -> int:
    """Bytes one rank sends to other ep ranks per step in its stage's mixture-of-experts layers: per layer and
    microbatch two all-to-alls forward and two backward, two more forward for a recomputed layer."""
    one = dispatch_bytes(cfg).all_to_all
    return one * cfg.microbatches * (4 * moe_layers + 2 * recomputed)


def moe_layer_activation_bytes(cfg: Config, recompute: bool, flash: bool = True) -> int:
    """Activation bytes one mixture-of-experts layer keeps for backward per microbatch: its attention, norms and
    shared experts as a dense layer of the shared width keeps them (Korthikanti et al. 2022, §4,
    megazero.plan.activations), plus the router's tensors and the dispatch's kept rows (:func:`dispatch_bytes`);
    recomputed, only its input, as a dense layer."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    sp = p.sequence_parallel and p.tp > 1
    dense = activation_bytes_per_layer(local_seq_len(cfg), t.micro_batch, m.hidden, m.heads, p.tp, sp, recompute,
                                       flash=flash, precision=t.precision,
                                       ffn=m.moe.shared_experts * expert_hidden(m), kv_heads=m.kv_head_count,
                                       swiglu=True, head_dim=m.head_width)
    if recompute:
        return dense
    d = dispatch_bytes(cfg)
    return dense + d.router + d.saved

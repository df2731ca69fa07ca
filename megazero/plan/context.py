"""What context parallelism (``parallel.cp``) costs a rank: its part of every sequence, and its attention's
traffic over the cp group (parallel.context, parallel.ulysses; docs/context.md).

Each cp rank keeps 2 of every sequence's 2·cp chunks, s/cp tokens: every activation, logit and routed token a
plan counts per microbatch is that of s/cp tokens (:func:`local_seq_len`), and Ulysses keeps its exchanged
k/v and a second attention output besides (:func:`ulysses_kept_bytes`). Its FLOPs are those of s/cp tokens
attending over the whole sequence (megazero.costs, over dp x cp ranks), the model state the same as at cp 1
(ZeRO shards over dp x cp, megazero.plan.state_bytes). What cp adds is communication, per layer and microbatch:

- **ring** (``cp_mode: ring``): cp steps of attention, each over one block of K/V; before each of the first
  cp − 1 the next block's K and V (this rank's width: kv_heads/tp heads, one when fewer k/v heads than tp ranks)
  are posted to the next rank, at the activation dtype, and run under the step's attention. The backward
  sends the K/V around again, each step also carrying the fp32 dK/dV accumulated so far (posted after a
  step's block, waited after the next's), and one last hop of dK/dV home that nothing hides. A recomputed
  forward sends K/V again. Per step only what the block's attention cannot hide is exposed: the layer's
  attention time over cp (a forward a third of it, a backward two thirds). The slowest hop sets a step: one
  GPU's adapter when the group spans nodes (each hop is one rank's send to one peer);
- **all_to_all** (Ulysses): 4 all-to-alls forward (q, k, v in, the output back; k/v at their own width,
  repeated up to a multiple of cp), 4 backward, 4 more in a recomputed forward; (cp − 1)/cp of each tensor
  leaves the rank; on the critical path.

The cp group is cp ranks tp apart (rank order pp, dp, cp, tp).
"""
from __future__ import annotations

from dataclasses import dataclass

from megazero.config.schema import Config
from megazero.costs import plan_attention_share
from megazero.plan.cluster import Cluster
from megazero.plan.links import Efficiency, all_to_all
from megazero.plan.state_bytes import BYTES_PER_VALUE
from megazero.parallel.ulysses import kv_heads_for

GRAD_BYTES = 4  # the ring's dK/dV travel in fp32 (parallel.context_blocks.accumulator_dtype)


def local_seq_len(cfg: Config) -> int:
    """Tokens of each sequence on one cp rank: its two chunks of 2·cp (parallel.sequence)."""
    return cfg.model.seq_len // cfg.parallel.cp


def kv_heads_per_rank(cfg: Config) -> int:
    """k/v heads a tp rank holds: kv_heads/tp, or one (replicated over tp/kv_heads ranks) when fewer (models.llama)."""
    kv, tp = cfg.model.kv_head_count, cfg.parallel.tp
    return kv // min(kv, tp)


@dataclass(frozen=True)
class ContextBytes:
    """One rank's cp traffic for one layer and microbatch, in bytes."""

    kv: int  # ring: this rank's K and V, one transfer
    grads: int  # ring: their fp32 gradients, one transfer
    a2a: int  # Ulysses: leaving the rank in one pass's four all-to-alls

    def per_layer(self, cfg: Config, recomputed: bool = False) -> int:
        """Sent in one layer's forward and backward (and a recomputed forward)."""
        cp = cfg.parallel.cp
        if cp == 1:
            return 0
        if cfg.parallel.cp_mode == "all_to_all":
            return (2 + recomputed) * self.a2a
        return (cp - 1) * self.kv * (2 + recomputed) + cp * self.grads


def context_bytes(cfg: Config) -> ContextBytes:
    """What one layer's attention sends over cp per microbatch (the module's list); zeros at cp 1."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.cp == 1:
        return ContextBytes(0, 0, 0)
    tokens, d = t.micro_batch * local_seq_len(cfg), m.head_width
    kv = kv_heads_per_rank(cfg)
    values = 2 * tokens * kv * d  # K and V
    q = tokens * (m.heads // p.tp) * d  # q, and the output as wide
    moved = (2 * q + 2 * tokens * kv_heads_for(kv, p.cp) * d) * (p.cp - 1) // p.cp
    b = BYTES_PER_VALUE[t.precision]
    return ContextBytes(values * b, values * GRAD_BYTES, moved * b)


def ulysses_kept_bytes(cfg: Config, recompute: bool = False) -> int:
    """What a layer keeps for backward per microbatch under Ulysses beyond what a layer of s/cp tokens keeps
    (megazero.plan.activations, which counts q, k, v and one output, as the ring keeps them): the attention
    keeps the exchanged k and v, at their travelling width over the whole sequence, in place of this rank's
    own, and its output beside the one returned to the sequence split (the projection's input). Nothing for a
    recomputed layer (it keeps its input) nor for the ring, whose K/V blocks live for one step."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.cp == 1 or p.cp_mode != "all_to_all" or recompute:
        return 0
    kv = kv_heads_per_rank(cfg)
    width = 2 * (kv_heads_for(kv, p.cp) - kv) + m.heads // p.tp  # in heads of s/cp tokens
    return t.micro_batch * local_seq_len(cfg) * m.head_width * width * BYTES_PER_VALUE[t.precision]


def sent_bytes(cfg: Config, layers: int, recomputed: int) -> int:
    """Bytes one rank sends over cp per step: ``layers`` on its stage, ``recomputed`` of them recomputed."""
    one = context_bytes(cfg)
    return cfg.microbatches * ((layers - recomputed) * one.per_layer(cfg) + recomputed * one.per_layer(cfg, True))


def cp_seconds(cfg: Config, cluster: Cluster, c: Efficiency, attention: float, recomputed: float) -> float:
    """Exposed seconds of one layer's cp traffic per microbatch, given ``attention``, the seconds of the layer's
    attention products on this rank (forward + backward) and ``recomputed``, the share of layers whose forward
    runs again. The formula's attention FLOPs count the whole s x s; the kernel does the causal half at
    about half a weight matmul's efficiency, so the layer's matmul efficiency gives about the kernel's time."""
    p = cfg.parallel
    cp, tp = p.cp, p.tp
    if cp == 1:
        return 0.0
    one = context_bytes(cfg)
    if p.cp_mode == "all_to_all":
        passes = 2 + recomputed
        return all_to_all(cluster, passes * one.a2a, 4 * passes, cp, tp, c)
    bandwidth, latency = cluster.link(cp * tp > cluster.gpus_per_node)

    def hop(nbytes: float) -> float:
        return nbytes / (bandwidth * c.comm_eff) + latency

    # step 0 is the rank's own block, 1/cp of its causal attention; the other steps' blocks share the rest. A
    # document mask keeps ``attention`` of it: the own block keeps what it can, the other steps only what is left
    # (short documents: almost nothing, as parallel.context skips blocks without a shared document, so the
    # transfers under them go unhidden)
    causal = attention / plan_attention_share(cfg)
    own = min(attention, causal / cp)
    other = (attention - own) / (cp - 1)
    # forward step j posts the next K/V under its block (j < cp - 1)
    forward = max(0.0, hop(one.kv) - own / 3) + (cp - 2) * max(0.0, hop(one.kv) - other / 3)
    # backward step j: the next K/V (j < cp - 1) and the previous step's dK/dV (j >= 1) in flight
    backward = max(0.0, hop(one.kv) - 2 * own / 3) + (cp - 2) * max(0.0, hop(one.kv + one.grads) - 2 * other / 3)
    backward += max(0.0, hop(one.grads) - 2 * other / 3) + hop(one.grads)  # the last hop home: nothing hides it
    return forward * (1 + recomputed) + backward

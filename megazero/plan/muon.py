"""What Muon (``optim.name: muon``, ``parallel.zero.muon``) adds to a stage's step: its matrices gathered to their
owners and the updates scattered back (two all-to-alls per round over the stage's ranks), and Newton-Schulz on
each owner.

The matrices are counted from the real layer classes built on meta at tp = ep = 1 (their logical shapes, as
``parallel.zero.muon.muon_matrices`` picks them: the 2-D parameters of a layer, each routed expert's three).
Per rank and step, in fp32 elements leaving the rank:

- gather: every element of every matrix once, from one of its holders to the matrix's owner;
- scatter: every element to every rank that holds it: the tp ranks that hold it (1 for a tp-split matrix, tp
  for a replicated one or an expert, r for k/v heads on r ranks), times the shard group (dp x cp; edp x cp
  for the experts) when the states are not sharded.

Both are the stage's totals over its dp x cp x tp ranks, self-sends included (an owner's own pieces): what
a rank sends on average, which the owners' balance makes what each sends to within a matrix.

Newton-Schulz: every matrix once over the stage, spread evenly over its dp x cp x tp ranks; each partition
(dense, and the experts' at ep > 1) deals its matrices out one per rank and round: ceil(matrices / ranks)
rounds each (``parallel.zero.matrix_plan.assign_owners``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megazero.kernels.newton_schulz import newton_schulz_flops
from megazero.config.schema import Config
from megazero.plan.optimizer_step import OptimizerStep
from megazero.plan.params import _planning_comm
from megazero.models.arch import moe_layer_count
from megazero.models.llama import kv_replicas_needed
from megazero.models.stage import GPT
from megazero.parallel.zero.declared import EXPERT, reduce_group
from megazero.parallel.zero.muon import muon_matrices
from megazero.parallel.zero.policy import StagePolicy

STATE_BYTES = 4  # fp32: momentum and update travel as the optimizer holds them
WHAT = ("fp32 momenta and updates (each matrix gathered whole to one owner and its update scattered back), and "
        "Newton-Schulz on each owner")


@dataclass(frozen=True)
class LayerMatrices:
    """One layer's Muon matrices: (logical rows, columns, tp ranks holding each element, expert) each."""

    matrices: tuple[tuple[int, int, int, bool], ...]

    @property
    def flops(self) -> int:
        return sum(newton_schulz_flops(a, b) for a, b, _, _ in self.matrices)


def layer_matrices(cfg: Config, layer: int) -> LayerMatrices:
    """The Muon matrices of model layer ``layer``, built alone on meta at the config's tp and ep (so each
    parameter says how it is split): logical shapes, and over how many tp ranks each element is held."""
    par = cfg.parallel
    with torch.device("meta"):
        chunk = GPT(cfg.model, tp=_planning_comm(par.tp), layer_ids=[layer], first_stage=False, last_stage=False,
                    sequence_parallel=par.sequence_parallel,
                    kv_replicas=_planning_comm(kv_replicas_needed(cfg.model, par.tp), "kv"),
                    ep=_planning_comm(par.ep, "ep"))
    picked = muon_matrices([chunk])
    out = []
    for p in chunk.parameters():
        if not picked.get(id(p), False):
            continue
        if p.dim() == 3:  # this ep rank's E/ep experts, whole on every tp rank
            out += [(p.shape[1], p.shape[2], par.tp, True)] * (p.shape[0] * par.ep)
            continue
        split = p.tp_split_dim
        positions = 1 if split is None or par.tp == 1 else par.tp // p.tp_replicas
        shape = list(p.shape)
        if positions > 1:
            shape[split] *= positions
        out.append((shape[0], shape[1], par.tp // positions, reduce_group(p) == EXPERT))
    return LayerMatrices(tuple(out))


def muon_step(cfg: Config, layers: list[range]) -> OptimizerStep:
    """Muon's exchange and iterations for a stage holding ``layers`` (its chunks' layer ranges): its registry
    row's ``plan_step``."""
    m, par = cfg.model, cfg.parallel
    n_layers = sum(len(r) for r in layers)
    n_moe = sum(moe_layer_count(m, r) for r in layers)
    kinds = []
    if n_layers - n_moe:
        first_dense = next(i for r in layers for i in r if not moe_layer_count(m, range(i, i + 1)))
        kinds.append((layer_matrices(cfg, first_dense), n_layers - n_moe))
    if n_moe:
        first_moe = next(i for r in layers for i in r if moe_layer_count(m, range(i, i + 1)))
        kinds.append((layer_matrices(cfg, first_moe), n_moe))
    ranks = par.dp * par.cp * par.tp
    sharded = StagePolicy.of(cfg.zero.stage).shard_optimizer
    group = {False: par.dp * par.cp, True: par.dp // par.ep * par.cp}  # the shard group: dense, experts
    gather = scatter = 0
    count = {False: 0, True: 0}  # matrices of the dense and the experts' partitions
    for kind, n in kinds:
        for rows, cols, holders, expert in kind.matrices:
            gather += n * rows * cols  # once, to its owner
            scatter += n * rows * cols * holders * (1 if sharded else group[expert])  # to every holder
            count[expert and par.ep > 1] += n  # at ep 1 the experts are in the dense partition
    flops = sum(kind.flops * n for kind, n in kinds) / ranks
    rounds = sum(math.ceil(c / ranks) for c in count.values())  # each partition deals its own out
    # the received pieces, the assembled matrix, X and the next X (m x n each), and X X^T, its square and the
    # polynomial (min(m, n)^2 each)
    transient = max((4 * r * c + 3 * min(r, c) ** 2 for kind, _ in kinds for r, c, _, _ in kind.matrices), default=0)
    return OptimizerStep(STATE_BYTES * (gather + scatter) // ranks, 2 * rounds, flops, STATE_BYTES * transient, WHAT,
                         __name__)

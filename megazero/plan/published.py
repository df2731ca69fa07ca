"""Published throughput rows the step-time model (megazero.plan.step_time) is fitted to and checked against.

Each row is turned into a megazero config (configs/gpt13b.yaml with ``--set``-style overrides, then
``megazero.config.resolve.resolve`` for the row's GPUs) and predicted as TFLOP/s per GPU counted the way its source counts FLOPs. Shared by
bench/planner.py (the fit) and tests/plan/test_step_time.py (the acceptance check), so the table lives once;
the rows and the clusters are read when asked (:func:`rows`, :func:`cluster_of`), not at import.

Sources:

* ``narayanan``: Narayanan et al. 2021 (SC'21), "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", Table 1: GPT, A100-80GB (Selene), s = 2048, V = 51200, interleaved 1F1B,
  full activation recomputation, 16-bit mixed precision. FLOPs by Eq. 3,
  F = 96 B s l h^2 (1 + s/6h + V/16lh): the layers' FLOPs times 4/3 (the recomputed forward) plus the head's.
* ``mcore``: Megatron-Core on H100 (Megatron-LM README, 2024): s = 4096, V = 131072, dp = 48, with
  grad-reduce, param-gather and tp-comm overlap. "Model TFLOP/s": Megatron's num_floating_point_operations,
  72 B s l h^2 (1 + s/6h + V/12lh), model FLOPs without recompute: megazero.plan.stage_plan's ``flops_per_step``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megazero.config.load import load_config
from megazero.config.resolve import resolve
from megazero.config.schema import Config
from megazero.costs import flops_per_token, model_shape
from megazero.plan.cluster import Cluster, load_cluster
from megazero.plan.fits import stage_bytes
from megazero.plan.search import MEMORY_MARGIN, PLANNED_DEVICE  # a layout fits as in the search
from megazero.plan.stage_plan import make_plan
from megazero.plan.step_time import Constants, step_time
from megazero.models.arch import ffn_hidden

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "configs" / "gpt13b.yaml"


@dataclass(frozen=True)
class Row:
    name: str
    source: str  # narayanan | mcore
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float  # published, per GPU
    virtual: int = 1  # interleaved model chunks per pipeline rank (not published: see VIRTUAL below)
    named: bool = True  # one of the fitted rows (False: held back, a check of generalisation)


# Interleaving: the papers do not print v per row. Every pp > 1 row gets the largest v <= 4 that divides
# its layers per stage (Korthikanti et al. 2022 ran 175B and 530B at v = 3).
_ROWS = (
    Row("1.7B", "narayanan", 24, 2304, 24, 1, 1, 32, 512, 137),
    Row("3.6B", "narayanan", 32, 3072, 30, 2, 1, 64, 512, 138, named=False),
    Row("7.5B", "narayanan", 32, 4096, 36, 4, 1, 128, 512, 142),
    Row("18.4B", "narayanan", 48, 6144, 40, 8, 1, 256, 1024, 135, named=False),
    Row("39.1B", "narayanan", 64, 8192, 48, 8, 2, 512, 1536, 138, virtual=4),
    Row("76.1B", "narayanan", 80, 10240, 60, 8, 4, 1024, 1792, 140, virtual=3, named=False),
    Row("145.6B", "narayanan", 96, 12288, 80, 8, 8, 1536, 2304, 148, virtual=2),
    Row("310.1B", "narayanan", 128, 16384, 96, 8, 16, 1920, 2160, 155, virtual=3, named=False),
    Row("529.6B", "narayanan", 128, 20480, 105, 8, 35, 2520, 2520, 163, virtual=3, named=False),
    Row("1008B", "narayanan", 160, 25600, 128, 8, 64, 3072, 3072, 163, virtual=2),
    Row("1.7B-H100", "mcore", 16, 2048, 24, 1, 1, 48, 192, 408.8),
    Row("16B-H100", "mcore", 48, 6144, 32, 4, 1, 192, 192, 489.1),
    Row("70B-H100", "mcore", 64, 8192, 84, 8, 2, 768, 384, 419.7, virtual=3),
    Row("177B-H100", "mcore", 96, 12288, 96, 8, 6, 2304, 1152, 432.8, virtual=4),
)
CLUSTER = {"narayanan": "a100-80g", "mcore": "h100-80g"}
SEQ = {"narayanan": 2048, "mcore": 4096}
VOCAB = {"narayanan": 51200, "mcore": 131072}


def rows(named: Optional[bool] = None) -> list[Row]:
    """The published rows: all, the issue's fitted ones (``named=True``) or those held back (``False``)."""
    return [r for r in _ROWS if named is None or r.named is named]


def cluster_of(row_source: str) -> Cluster:
    """The cluster a row's source ran on, read from configs/clusters when asked."""
    return load_cluster(CLUSTER[row_source])


def _resolved(sets: list[str], gpus: int) -> Config:
    return resolve(load_config(BASE, sets), gpus, PLANNED_DEVICE, planned=True)


def micro_batch(row: Row) -> int:
    """1, as Megatron ran them; 2 where megazero's tp_overlap (Domino: each microbatch as two halves of one
    sequence each) needs an even micro-batch: the H100 rows with tp > 1. Each half's matmuls then have the
    shapes of Megatron's micro-batch of 1."""
    return 2 if row.source == "mcore" and row.tp > 1 else 1


def row_config(row: Row, recompute: bool | None = None) -> Config:
    """The row as a megazero config: GPT, bf16, micro-batch 1, interleaved where pp > 1.

    A100 rows (Megatron-LM 2021): full recompute, no sequence parallelism or tp overlap, data parallelism
    without ZeRO, gradients reduced in the model's 16 bits (Megatron's fp16 default then). H100 rows
    (Megatron-Core 2024): sequence parallelism and tp-comm overlap, ZeRO-1 (the distributed optimizer), fp32
    gradient reduction (Megatron's bf16 default); no recompute when the plan fits in MEMORY_MARGIN of the GPU
    without it, else the fewest recomputed layers per chunk (``model.checkpoint_layers``) that fit
    (``recompute`` forces none or full)."""
    a100 = row.source == "narayanan"
    sets = [f"model.layers={row.layers}", f"model.hidden={row.hidden}", f"model.heads={row.heads}",
            f"model.seq_len={SEQ[row.source]}", f"model.vocab_size={VOCAB[row.source]}",
            f"parallel.tp={row.tp}", f"parallel.pp={row.pp}", "parallel.dp=auto",
            f"train.global_batch={row.batch}", f"train.micro_batch={micro_batch(row)}", "train.precision=bf16",
            f"parallel.sequence_parallel={'false' if a100 or row.tp == 1 else 'true'}",
            f"parallel.tp_overlap={'false' if a100 or row.tp == 1 else 'true'}",
            f"zero.stage={0 if a100 else 1}", f"zero.grad_dtype={'model' if a100 else 'fp32'}"]
    if row.pp > 1:
        sets += ["parallel.schedule=interleaved", f"parallel.virtual_stages={row.virtual}"]
    else:
        sets += ["parallel.schedule=1f1b", "parallel.virtual_stages=1"]
    if recompute is not None or a100:
        full = a100 if recompute is None else recompute
        return _resolved(sets + [f"model.activation_checkpointing={str(full).lower()}"], row.gpus)
    # H100: no recompute if the plan fits; else the fewest checkpointed layers per chunk that fit
    cfg = _resolved(sets + ["model.activation_checkpointing=false"], row.gpus)
    per_chunk = row.layers // (row.pp * row.virtual)
    for k in range(1, per_chunk + 1):
        if fits(cfg, row):
            break
        cfg = _resolved(sets + ["model.activation_checkpointing=true",
                                f"model.checkpoint_layers={0 if k == per_chunk else k}"], row.gpus)
    return cfg


def fits(cfg: Config, row: Row) -> bool:
    """The row's config fits its GPUs as the search counts it (MEMORY_MARGIN of the memory)."""
    budget = cluster_of(row.source).memory_gb * 1e9 * MEMORY_MARGIN
    return max(stage_bytes(cfg, s, "cuda") for s in make_plan(cfg).stages) <= budget


def counted_flops(cfg: Config, row: Row, plan=None) -> float:
    """FLOPs per step as the row's source counts them, from the plan's model FLOPs (the one formula)."""
    model = (make_plan(cfg) if plan is None else plan).flops_per_step
    if row.source == "mcore":
        return model
    m = cfg.model
    head = flops_per_token(0, m.hidden, ffn_hidden(m), m.seq_len, m.padded_vocab, **model_shape(m))
    head *= cfg.train.global_batch * m.seq_len
    return (model - head) * 4 / 3 + head  # Eq. 3: the layers' forward counted again for recompute


def predict(row: Row, constants: Optional[Constants] = None, cfg: Optional[Config] = None, plan=None,
            cluster: Optional[Cluster] = None):
    """(predicted TFLOP/s per GPU as the source counts, StepTime, config) of a row; ``cfg``, ``plan`` (its
    make_plan) and ``cluster`` (its cluster_of), when given, are reused: a fit predicts each row thousands of
    times."""
    c = Constants() if constants is None else constants
    c = dataclasses.replace(c, materialised_scores=row.source == "narayanan")
    cfg = row_config(row) if cfg is None else cfg
    st = step_time(cfg, cluster_of(row.source) if cluster is None else cluster, c, plan)
    return counted_flops(cfg, row, plan) / (st.total * row.gpus) / 1e12, st, cfg

"""The rules of context parallelism (``parallel.cp``, ``parallel.cp_mode``): what the split of a sequence over cp
ranks needs of the model and the other dimensions (``parallel.context``)."""
from __future__ import annotations

from megazero.config.schema import Config
from megazero.errors import invalid


def check_context(cfg: Config) -> None:
    """Each rank holds chunks i and 2cp-1-i of every sequence (the head-tail split): the sequence splits into
    2cp equal chunks. Ulysses (all_to_all) trades the sequence split for a head split: each tp rank's heads
    split evenly over cp."""
    m, p, src = cfg.model, cfg.parallel, cfg.source
    _check_documents(cfg)
    if p.cp == 1:
        return
    if m.seq_len % (2 * p.cp):
        raise invalid(src, "model.seq_len", m.seq_len, f"must be divisible by 2*parallel.cp = {2 * p.cp} (each cp "
                      "rank holds two equal chunks of every sequence)")
    if p.cp_mode == "all_to_all" and (m.heads // p.tp) % p.cp:
        raise invalid(src, "parallel.cp_mode", p.cp_mode, f"splits each tp rank's heads over cp: model.heads/"
                      f"parallel.tp = {m.heads}/{p.tp} = {m.heads // p.tp} is not divisible by parallel.cp={p.cp}; "
                      "use cp_mode=ring or a cp that divides it")


def _check_documents(cfg: Config) -> None:
    """Per-sample document masks and positions do not split into tp_overlap's two half-batches."""
    for key in ("document_mask", "reset_positions"):
        if getattr(cfg.data, key) and cfg.parallel.tp_overlap:
            raise invalid(cfg.source, f"data.{key}", True, "does not combine with parallel.tp_overlap=true (its "
                          "halves split the batch, documents are per sample); use one of them")

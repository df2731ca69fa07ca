"""What one rank keeps of the activations: per layer, and at the peak of its pipeline schedule.

Per layer: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §4,
Eq. (1)-(5) (:func:`activation_bytes_per_layer`); over the schedule: the microbatches in flight along one
rank's action list (:func:`activation_peak`, over a list :func:`peak_microbatches` shortens), and the
schedule's idle share (:func:`pipeline_bubble`).
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Sequence

from megazero.parallel.schedules import Action

LOGIT_BYTES = 4  # the cross entropy keeps a float32 softmax of this rank's vocabulary slice


def activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                               sequence_parallel: bool = False, recompute: bool = False, flash: bool = True,
                               precision: str = "bf16", ffn: int | None = None, kv_heads: int | None = None,
                               swiglu: bool = False, head_dim: int | None = None) -> int:
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
    product), 8·sbf; norms, block inputs and dropout masks are as GPT-2's 10. A head width other than h/a
    (``head_dim``, Qwen3's) scales q, k, v and the attention output by a·head_dim/h.
    """
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    f = 4 * h if ffn is None else ffn
    kv = a if kv_heads is None else kv_heads
    width = Fraction(a * head_dim, h) if head_dim else 1  # q's width over h
    sbh = s * b * h
    if recompute:
        per = Fraction(2 * sbh, t if sequence_parallel else 1)
    else:
        split = (4 + Fraction(4 * kv, a * min(kv, t)) * t) * width + Fraction((8 if swiglu else 4) * f, h)  # then / t
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


def peak_microbatches(schedule: str, pp: int, m: int, v: int = 1) -> int:
    """The fewest microbatches whose schedule has the same :func:`activation_peak` on every rank as ``m``'s:
    ``m``, or fewer when ``m`` is past that. A search plans thousands of layouts of up to 2^20 passes each
    (megazero.config.rules); listing each whole schedule would take minutes.

    Why the peak stops changing (parallel.schedules): 1F1B and zb1p run at most pp - 1 warm-up forwards, then
    pairs of one forward and one backward (zb1p: a W after each B from the rank's r-th on), then only free;
    interleaved runs at most (pp - r - 1) * 2 + (v - 1) * pp warm-up forwards (all of them only when m == pp),
    then forward-backward pairs whose chunks repeat every pp * v virtual microbatches, then only frees. So once
    the warm-up is whole and the steady state holds two of its periods, more microbatches only repeat held
    amounts already reached. GPipe holds all m: no fewer gives its peak."""
    if schedule == "gpipe":
        return m
    enough = 4 * pp if schedule == "interleaved" else 2 * pp + 2  # interleaved: a multiple of pp, never pp
    return min(m, enough)


def pipeline_bubble(schedule: str, pp: int, m: int, v: int = 1) -> float:
    """Idle fraction of a step: (p-1)/(m+p-1), and (p-1)/(v·m+p-1) interleaved (Narayanan et al. 2021);
    zb1p with equal F, B and W costs: (p-1)/(3m+p-1) (ZB-H1 idles (p-1)(F+B-W), Qi et al. 2023, §3.1)."""
    if schedule == "zb1p":
        return (pp - 1) / (3 * m + pp - 1)
    chunks = v if schedule == "interleaved" else 1
    return (pp - 1) / (chunks * m + pp - 1)


def attention_mask_bytes(cfg) -> tuple[int, int]:
    """(kept per layer and microbatch, temporary) bytes of the document mask an attention path builds under
    ``data.document_mask``. kernels.attention=torch (at cp 1, or Ulysses' whole sequence per rank): SDPA saves
    its float copy of the (micro_batch, 1, s, s) mask for backward in every layer not recomputed, and the
    boolean mask exists while it is made ("blocks" too, where s is one block). "blocks" and a cp ring on the
    CPU keep nothing: one block of up to 256 query rows holds its float mask and three boolean ones over its
    keys (at most the rank's whole sequence), and the keys' k/v copied and widened to the query heads. Triton
    (and a ring on a GPU, which always runs it) builds none: it reads the ids."""
    m, t, par, impl = cfg.model, cfg.train, cfg.parallel, cfg.kernels.attention
    if not cfg.data.document_mask or impl == "triton":
        return 0, 0
    value = 4 if t.precision == "fp32" else 2  # the float mask is in the attention's dtype
    b, s = t.micro_batch, m.seq_len
    ring = par.cp > 1 and par.cp_mode == "ring"
    from megazero.kernels.document_attention import BLOCK

    if (impl == "torch" or s <= BLOCK) and not ring:  # blocks on one block's sequence is the dense path
        return b * s * s * value, b * s * s

    keys = s // par.cp if ring else s  # a ring's first step: the rank's own two chunks
    heads = m.heads // par.tp // (par.cp if par.cp > 1 and not ring else 1)
    rows = min(BLOCK, keys)
    return 0, b * rows * keys * (value + 3) + 2 * b * heads * keys * m.head_width * value

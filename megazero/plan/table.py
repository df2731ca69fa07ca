"""The --dry-run plan as text: a header, one row per pipeline stage, what the columns assume, the totals."""
from __future__ import annotations

from typing import Sequence

from megazero.costs import plan_attention_share
from megazero.plan.activations import attention_mask_bytes
from megazero.plan.context import local_seq_len
from megazero.plan.fits import stage_bytes
from megazero.plan.stage_plan import GB, Plan, StageBalance
from megazero.plan.state_bytes import (ADAM_STATE_BYTES, BYTES_PER_VALUE, grad_bytes_per_param,
                                      optimizer_bytes_per_param)
from megazero.models.arch import expert_hidden, moe_layer_count
from megazero.parallel.zero.policy import StagePolicy
from megazero.parallel.zero.registry import OPTIMIZERS


def fmt_count(n: float) -> str:
    """12,853,626,880 (12.85B): exact with separators, then a short form."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n:,.0f} ({n / div:.2f}{suffix})"
    return f"{n:,.0f}"


def _document_note(cfg) -> str:
    """How the FLOPs count the document mask: the attention its documents leave, or causal without an estimate."""
    d = cfg.data
    if not d.document_mask:
        return ""
    if not d.document_tokens:
        return "; document_mask: attention counted causal (set data.document_tokens to plan what the mask skips)"
    return (f"; document_mask: attention x {plan_attention_share(cfg):.4f}, the share of causal attention "
            f"documents of {d.document_tokens:,} tokens leave (megazero.costs.expected_document_share)")


def _mask_note(cfg) -> list[str]:
    """The document mask's bytes where the attention path builds one (in the activation columns)."""
    kept, temporary = attention_mask_bytes(cfg)
    if not kept and not temporary:
        return []
    if kept:
        return [f"  document mask: kernels.attention=torch keeps a dense (micro_batch, 1, {cfg.model.seq_len:,}, "
                f"{cfg.model.seq_len:,}) mask in each layer not recomputed ({kept / GB:.3f} GB a layer and "
                f"microbatch) and builds a boolean one ({temporary / GB:.3f} GB) per call; auto builds none of "
                "(s, s)"]
    return [f"  document mask: kernels.attention={cfg.kernels.attention} keeps none; one block's mask and k/v "
            f"copies while it runs ({temporary / GB:.3f} GB)"]


def fmt_flops(x: float) -> str:
    """1.721e+17 (172.1 PFLOP): the exponent form, then the nearest SI unit."""
    for div, unit in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
        if x >= div:
            return f"{x:.3e} ({x / div:,.1f} {unit}FLOP)"
    return f"{x:.3e} FLOP"


def fmt_ranges(values: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out: list[str] = []
    vals = sorted(values)
    start = prev = vals[0]
    for x in vals[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}-{prev}" if prev > start else f"{start}")
        if x is not None:
            start = prev = x
    return ",".join(out)


def fmt_layer_counts(counts: Sequence[int]) -> str:
    """[5, 3]; a long list with its runs folded: [21, 20 x 30, 19]."""
    if len(counts) <= 16:
        return str(list(counts))
    runs: list[list[int]] = []
    for c in counts:
        if runs and runs[-1][0] == c:
            runs[-1][1] += 1
        else:
            runs.append([c, 1])
    return "[" + ", ".join(f"{c} x {k}" if k > 1 else str(c) for c, k in runs) + "]"


def fmt_balance(balance: StageBalance) -> str:
    """Layers per (virtual) stage, each pipeline rank's share of the work, the busiest over the least busy;
    and what parallel.pp_layers=auto would give, where it differs."""
    def imbalance(costs: Sequence[float]) -> str:
        return f"busiest / least {max(costs) / min(costs):.2f}"

    costs = balance.rank_costs
    total = sum(costs)
    shares = (" / ".join(f"{c / total:.2f}" for c in costs) if len(costs) <= 8
              else f"{min(costs) / total:.4f} to {max(costs) / total:.4f} over {len(costs)} ranks")
    text = f"layers {fmt_layer_counts(balance.counts)}, cost share {shares} ({imbalance(costs)})"
    if balance.auto_counts != balance.counts:
        text += (f"; parallel.pp_layers=auto: {fmt_layer_counts(balance.auto_counts)}, "
                 f"{imbalance(balance.auto_rank_costs)}")
    return text


def _table(header: list[str], rows: list[list[str]], left: int) -> list[str]:
    """Aligned columns: the first ``left`` columns flush left, the rest flush right."""
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    return ["  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in [header] + rows]


def format_plan(plan: Plan) -> str:
    """The human-readable plan: a header, one row per pipeline stage, what the columns assume, totals."""
    cfg = plan.cfg
    m, par, t, z = cfg.model, cfg.parallel, cfg.train, cfg.zero
    ckpt = m.activation_checkpointing
    sp = par.sequence_parallel and par.tp > 1
    sched = par.schedule + (f" (v={par.virtual_stages})" if par.schedule == "interleaved" else "")
    where = {"params": z.offload_params, "optimizer": z.offload_optimizer}
    policy = StagePolicy.of(z.stage)
    gathers, grad_bufs = policy.shard_params, policy.shard_grads  # ZeRO-3's gathered layers, ZeRO-2/3's buffers
    moe = m.moe.experts > 0
    ep = f" (ep {par.ep} x edp {par.dp // par.ep})" if moe else ""
    context = par.cp > 1
    cp = f" x cp {par.cp} ({par.cp_mode})" if context else ""
    lines = [
        f"dry run of {cfg.source}: world {plan.world_size} = tp {par.tp} x pp {par.pp} x dp {par.dp}{ep}{cp} | "
        f"zero stage {z.stage} | precision {t.precision} | schedule {sched} | sequence parallel "
        f"{'on' if sp else 'off'} | activation checkpointing {'on' if ckpt else 'off'}",
        f"model: {m.arch}, {m.layers} layers, hidden {m.hidden:,}, {m.heads} heads"
        f"{f' ({m.kv_head_count} k/v)' if m.kv_head_count != m.heads else ''}, ffn {m.ffn_hidden:,}, "
        f"seq {m.seq_len:,}, vocab {m.vocab_size:,} (padded {m.padded_vocab:,}"
        f"{', untied head' if not m.tie_embeddings else ''})",
    ] + ([_moe_line(plan)] if moe else []) + [
        "",
        f"per rank, one row per pipeline stage (its tp{', cp' if context else ''} and dp ranks hold and do the "
        "same); memory in GB (1e9 bytes)",
    ]
    header = ["stage", "layers", "global ranks", "params/rank"] + (["experts/rank"] if moe else [])
    header += [k + (f" ({where[k]})" if where.get(k, "none") != "none" else "")
               for k in ("params", "grads", "optimizer")]
    disk = z.offload_optimizer == "nvme"  # the states on a local disk: their own column, beside the host's buffers
    header += ["device"] + (["experts"] if moe else []) + ["cpu"] + (["nvme"] if disk else []) + [
        "act ckpt" + ("*" if ckpt else ""),
                                                           "act full" + ("" if ckpt else "*"), "mb held"] \
        + (["gathered"] if gathers else []) + (["grad bufs"] if grad_bufs else []) \
        + (["dispatch", "a2a/step"] if moe else []) + (["cp/step"] if context else []) + ["total*", "TFLOP/step"]
    rows = []
    for s in plan.stages:
        ms = s.model_state
        state = [f"{ms[k] / GB:.2f}" for k in ("params", "grads", "optimizer", "device_total")]
        rows.append([str(s.pp_rank), ",".join(f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start)
                                              for r in s.layers),
                     f"{fmt_ranges(s.ranks)} ({par.dp} dp x {f'{par.cp} cp x ' if context else ''}{par.tp} tp)",
                     f"{s.params:,}"]
                    + ([f"{s.experts:,}"] if moe else []) + state
                    + ([f"{s.expert_state['device_total'] / GB:.2f}"] if moe else [])
                    + [f"{ms['cpu_total'] / GB:.2f}"] + ([f"{ms['nvme_total'] / GB:.2f}"] if disk else [])
                    + [f"{s.act_ckpt / GB:.2f}", f"{s.act_full / GB:.2f}", str(s.in_flight)]
                    + ([f"{s.gathered / GB:.2f}"] if gathers else [])
                    + ([f"{s.grad_buffers / GB:.2f}"] if grad_bufs else [])
                    + ([f"{s.dispatch / GB:.2f}", f"{s.all_to_all / GB:.2f}"] if moe else [])
                    + ([f"{s.context / GB:.2f}"] if context else [])
                    + [f"{stage_bytes(cfg, s, 'cuda') / GB:.2f}",
                       f"{s.flops / 1e12:,.{1 if s.flops >= 1e13 else 4}f}"])
    lines += _table(header, rows, left=3)
    b, k = BYTES_PER_VALUE[t.precision], optimizer_bytes_per_param(t.precision)
    states, per_element = "Adam moments", OPTIMIZERS[cfg.optim.name].state_bytes(10 ** 6, 1, False) / 10 ** 6
    if per_element != ADAM_STATE_BYTES:  # the row's own states (1-bit Adam: its momentum and errors whole)
        k = f"{k - ADAM_STATE_BYTES + per_element:g} (unsharded)"
        states = f"{cfg.optim.name}'s states, its registry row's state_bytes"
    g = grad_bytes_per_param(t.precision, z.grad_dtype)
    last = plan.stages[-1]
    lines += [
        "",
        f"  model state: ZeRO stage {z.stage} over dp {par.dp}{f' x cp {par.cp}' if context else ''}, {b} B/param "
        f"for params, {g} for grads, {k} B/param optimizer ({states}{' + fp32 master' if b != 4 else ''}); "
        "Rajbhandari et al. SC'20, Fig. 1",
        f"  activations: Korthikanti et al. 2022 §4 per layer, {'fp32' if b == 4 else '16-bit'}, flash attention "
        f"(no s x s scores), micro_batch {t.micro_batch}; x layers x microbatches held ('mb held', peak of the "
        f"{par.schedule} schedule); act ckpt adds one layer being recomputed"
        + (f" where a chunk has no more than {m.checkpoint_layers} layers (one that keeps some layers' full "
           f"activations frees them before it recomputes)" if m.checkpoint_layers else "") + "; the last stage adds fp32 logits "
        + (f"({last.logits / GB:.2f} GB per microbatch)" if not t.loss_chunk_tokens else
           f"of one chunk of {t.loss_chunk_tokens} tokens, while it is computed ({last.logits / GB:.2f} GB)"),
    ] + _mask_note(cfg) + (_moe_notes(plan) if moe else []) + ([_context_note(plan)] if context else []) \
        + _optimizer_note(plan, cfg.optim.name) + [
        "  * = what this config uses; total* = device model state + activations"
        + (" + gathered (ZeRO-3: the root and two layers whole, or the whole stage with "
           "zero.reshard_after_forward=false)" if gathers else "")
        + (" + grad bufs (up to three whole-bucket gradient buffers beside the shard: two reductions in flight "
           "and the bucket filling; a bucket is zero.bucket_mb, or a larger parameter" + (", or a layer"
           if gathers else "") + ")" if grad_bufs else "")
        + (" + dispatch" if moe else "")
        + " (no comm buckets, temporaries, CUDA context or fragmentation)",
        "  TFLOP/step: model FLOPs of one rank of the stage (megazero.costs formula on its layers and head; "
        "recomputation not counted" + ("; active parameters: top_k routed experts, not E" if moe else "") + ")",
        "  pp stages: each pipeline rank's share of the work per token: those FLOPs, plus each layer's elementwise "
        "work, the cross entropy and the embedding lookup as FLOPs-equivalents of their memory traffic on "
        "launch.device (megazero.costs.pipeline_costs); "
        "parallel.pp_layers=auto splits the layers to least load the busiest",
        "",
        "totals",
    ]
    per_rank = plan.flops_per_step / plan.world_size
    bubble_formula = "(p-1)/(v*m+p-1)" if par.schedule == "interleaved" else "(p-1)/(m+p-1)"
    lines += ["  " + ln for ln in _table(["", ""], [
        ["parameters (whole model)", fmt_count(plan.total_params)],
    ] + ([["active parameters", f"{fmt_count(plan.active_params)} per token (top_k {m.moe.top_k} of "
                                f"{m.moe.experts} routed experts{' + shared' if m.moe.shared_experts else ''})"]]
         if moe else []) + [
        ["model FLOPs per step", f"{fmt_flops(plan.flops_per_step)}; even share per rank (/ world "
                                 f"{plan.world_size}) {fmt_flops(per_rank)}" + _document_note(cfg)],
        ["tokens per step", f"{plan.tokens_per_step:,} ({t.global_batch:,} sequences x {m.seq_len:,})"],
        ["microbatches per rank", f"{plan.microbatches} (global_batch {t.global_batch:,} / "
                                  f"(micro_batch {t.micro_batch} x dp {par.dp}))"],
        ["pipeline bubble", f"{100 * plan.bubble:.2f}% = {bubble_formula} with p={par.pp}, m={plan.microbatches}"
                            + (f", v={par.virtual_stages}" if par.schedule == "interleaved" else "")],
        ["pp stages", fmt_balance(plan.balance)],
    ], left=2)[1:]]
    return "\n".join(lines)


def _context_note(plan: Plan) -> str:
    """What context parallelism's columns assume (megazero.plan.context)."""
    par = plan.cfg.parallel
    how = ("per layer and microbatch (cp-1) transfers of its K and V forward, again in backward with cp of "
           "their fp32 gradients, and again in a recomputed forward" if par.cp_mode == "ring" else
           "per layer and microbatch 4 all-to-alls forward and 4 backward (4 more recomputed) of q, k, v and the "
           "output, (cp-1)/cp of each")
    return (f"  context: each of the cp {par.cp} ranks keeps {local_seq_len(plan.cfg):,} tokens of every sequence "
            f"(activations and logits at that length; model state over dp x cp); cp/step: GB a rank sends to "
            f"other cp ranks per step, {how}")


def _moe_line(plan: Plan) -> str:
    """The model line of a mixture of experts."""
    m = plan.cfg.model
    moe = m.moe
    n = moe_layer_count(m, range(m.layers))
    where = f"layers {moe.dense_layers}+" + (f" every {moe.every}" if moe.every > 1 else "")
    shared = f" + {moe.shared_experts} shared" if moe.shared_experts else ""
    return (f"mixture of experts: {n} of {m.layers} layers ({where}), {moe.experts} experts{shared} of width "
            f"{expert_hidden(m):,}, top {moe.top_k}, {moe.router} router"
            + (f" (x{moe.routed_scaling_factor:g})" if moe.routed_scaling_factor != 1 else "")
            + (f", capacity {moe.capacity_factor:g}" if moe.capacity_factor else ", dropless"))


def _moe_notes(plan: Plan) -> list[str]:
    """What the mixture-of-experts columns assume: the experts' sharding, the dispatch, the all-to-alls."""
    cfg = plan.cfg
    m, par, z = cfg.model, cfg.parallel, cfg.zero
    d = plan.dispatch
    edp = par.dp // par.ep
    return [
        f"  experts: {m.moe.experts // par.ep} of {m.moe.experts} routed experts per layer on a rank (ep "
        f"{par.ep}); experts/rank their parameters, experts their device model state (in device), ZeRO stage "
        f"{z.stage} over edp = dp / ep = {edp} (the dense parameters' over dp {par.dp})",
        f"  dispatch: one mixture-of-experts layer, per microbatch on a rank, R = tokens x top_k = {d.rows:,} rows "
        f"(balanced routing, no padding to E x capacity): buffers peak {d.peak / GB:.3f} GB, of which "
        f"{d.saved / GB:.3f} GB kept for backward (in act; with the router's {d.router / GB:.3f} GB); the rest "
        f"is the dispatch column (megazero.plan.dispatch)",
        f"  a2a/step: GB a rank sends to other ep ranks per step: per mixture-of-experts layer and microbatch "
        f"2 all-to-alls forward and 2 backward (2 more when recomputed) of R x h x (ep-1)/ep values, "
        f"{d.all_to_all / GB:.3f} GB each",
    ]


def _optimizer_note(plan, name: str) -> list[str]:
    """The optimizer's extra step work (its registry row's plan_step), on the busiest stage; none for most."""
    busiest = max(plan.stages, key=lambda st: (st.optimizer_step.sent, st.optimizer_step.flops))
    s = busiest.optimizer_step
    if not (s.calls or s.flops):
        return []
    return [f"  {name}: per rank and step, {s.sent / GB:.2f} GB in {s.calls} all-to-alls over its stage's "
            f"{len(busiest.ranks)} "
            f"ranks and {s.flops / 1e12:.2f} TFLOP (fp32): {s.what}; {s.transient / GB:.2f} GB alive at once for "
            f"the largest piece (not in total*); {s.source}"]

"""The layouts a search considers: the knobs (tp, pp, dp, virtual stages, schedule, ZeRO stage, micro-batch,
recompute, for a mixture of experts ep, dividing dp and the expert count, and context parallelism: cp and its
mode), ``--layout``'s fixed ones, and every combination of a GPU count's, in the order the search walks.

Where it is narrowed to keep a search to seconds: tp stays within a node unless --layout fixes it; at most
MAX_MICRO_BATCHES micro-batches per layout; interleaving at 2, 4, 8... chunks; gpipe only when fixed; cp at
powers of two that leave each rank at least MIN_CP_TOKENS of a sequence, unless --layout fixes it; ep over
the divisors of dp that divide the expert count (megazero.plan.search skips those whose expert states cannot
fit before planning them). A search that would still take minutes (a GPU count with hundreds of divisors beside
a deep model and a huge batch) is refused in one line, at once over MAX_LAYOUTS layouts or MAX_LISTED_WORK
(:func:`bounded`), or when its plans pass MAX_SEARCH_WORK (:func:`plan_work`, counted by megazero.plan.search):
--layout narrows it.
"""
from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass
from typing import Iterator

from megazero.config.context_rules import check_context
from megazero.config.ranges import choices
from megazero.config.schema import Config
from megazero.errors import UserError, shown
from megazero.plan.activations import peak_microbatches
from megazero.plan.state_bytes import ZERO_STAGES

KNOBS = ("tp", "pp", "dp", "virtual_stages", "schedule", "zero_stage", "micro_batch", "recompute", "ep", "cp",
         "cp_mode")
# gpipe is not searched (it can be fixed with --layout): 1F1B's bubble, but every microbatch's activations held.
SEARCHED_SCHEDULES = ("1f1b", "zb1p", "interleaved")
MAX_MICRO_BATCHES = 8  # micro-batch values tried per layout: a geometric spread of the batch's divisors
# cp > 1 is searched only while a rank keeps at least this many tokens of each sequence: context parallelism is
# for sequences whose activations one rank cannot hold. With fewer, the ring's transfers across nodes outgrow the
# attention that hides them (by the plan's own cp term, Llama 3 8B's ring across H100 nodes breaks even at
# ~2,600-4,600 tokens a rank, forward and backward, by tp), its matmuls thin, and dp takes the same ranks without
# either cost. It also leaves the searches of 2K-8K-token configs (every shipped one) as they were: each cp
# size and mode multiplies a search's layouts.
MIN_CP_TOKENS = 8192
# ZeRO stages in the order a layout tries them: ZeRO-1 first, whose memory tells ZeRO-0's (the same
# activations beside a larger optimizer state)
ZERO_ORDER = (1, 0, 2, 3)
# A search's size, bounded so that the largest accepted input answers in seconds, not hours. Each layout is
# put to the config rules (about a millisecond) and each one they accept and the memory bound leaves is planned
# (:func:`plan_work`): its schedule listed and walked per pipeline stage (megazero.plan.stage_plan), a fraction of
# a microsecond per virtual microbatch, and each stage planned and timed, about a hundred times that. A core
# plans about 1.5 million units a second. Two bounds are checked at once, on the listed layouts: their count
# (MAX_LAYOUTS), and the work of planning each once (MAX_LISTED_WORK). The pruned search plans a quarter of
# that or less (deepseek-v3-shape on 2,048 GPUs: 39,200 layouts, 39 million units listed, 5 million planned);
# the shipped configs list about 40 million at most on real clusters, while a GPU count of hundreds of divisors
# beside a deep model and a huge batch lists hundreds of millions (llama3-70b on 720,720 GPUs with an
# 11.5-million-sequence batch: 246 million, 30 s of plans before MAX_SEARCH_WORK stopped it). MAX_SEARCH_WORK
# then bounds the plans made.
MAX_LAYOUTS = 2 ** 16
MAX_LISTED_WORK = 2 ** 27
MAX_SEARCH_WORK = 2 ** 24
STAGE_WORK = 100  # a stage's plan and step time, in the units of one virtual microbatch of its schedule


@dataclass(frozen=True)
class Layout:
    """One point of the search; recompute is 'none', 'full' or k (model.checkpoint_layers) as text."""

    tp: int
    pp: int
    dp: int
    virtual_stages: int
    schedule: str
    zero_stage: int
    micro_batch: int
    recompute: str
    ep: int = 1  # expert parallelism, carved out of dp (a mixture of experts only)
    cp: int = 1  # context parallelism: each sequence split over cp ranks
    cp_mode: str = "ring"  # ring | all_to_all (Ulysses), at cp > 1

    def label(self) -> str:
        """knob=value for each knob, less ep and cp at 1 (and cp_mode with them)."""
        hidden = {"ep": self.ep == 1, "cp": self.cp == 1, "cp_mode": self.cp == 1}
        return " ".join(f"{k}={v}" for k, v in asdict(self).items() if not hidden.get(k))


@dataclass(frozen=True)
class Ranked:
    """A layout that fits, with what the step-time model predicts for it."""

    layout: Layout
    memory_gb: float
    step_s: float
    tflops_per_gpu: float
    mfu: float

    def as_dict(self) -> dict:
        return {**asdict(self.layout), "memory_gb": self.memory_gb, "step_s": self.step_s,
                "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu}


def parse_layout(text: str) -> dict:
    """``tp=8,pp=4,recompute=full`` -> the fixed knobs; a bad knob or value is one line."""
    fixed: dict = {}
    for item in (text.split(",") if text.strip() else []):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or key not in KNOBS:
            raise UserError(f"--layout {shown(item)} is invalid; expected knob=value with a knob of {', '.join(KNOBS)}")
        if key in fixed:
            raise UserError(f"--layout: {key} is given twice")
        fixed[key] = _knob_value(key, value)
    if not fixed:
        raise UserError(f"--layout {shown(text)} is invalid; expected e.g. tp=8,pp=4,recompute=full")
    return fixed


def _knob_value(key: str, value: str):
    from megazero.parallel.schedules import SCHEDULES

    named = {"schedule": SCHEDULES, "cp_mode": choices("parallel", "cp_mode")}
    if key in named:
        if value not in named[key]:
            raise UserError(f"--layout {key}={shown(value)} is invalid; valid: {' | '.join(named[key])}")
        return value
    if key == "recompute":
        if value in ("none", "full") or (value.isdigit() and 0 < int(value) < 2 ** 31):
            return value
        raise UserError(f"--layout recompute={shown(value)} is invalid; valid: none | full | a layer count k >= 1")
    low = 0 if key == "zero_stage" else 1
    if not (value.isdigit() and len(value) < 10) or int(value) < low \
            or (key == "zero_stage" and int(value) not in ZERO_STAGES):
        valid = "0 | 1 | 2 | 3" if key == "zero_stage" else "an integer >= 1"
        raise UserError(f"--layout {key}={shown(value)} is invalid; valid: {valid}")
    return int(value)


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _spread(values: list[int], most: int) -> list[int]:
    """At most ``most`` of sorted values, evenly by index (the divisors of a batch are near-geometric)."""
    if len(values) <= most:
        return values
    return sorted({values[round(i * (len(values) - 1) / (most - 1))] for i in range(most)})


def candidates(base: Config, gpus: int, fixed: dict, max_tp: int = 2 ** 20) -> Iterator[Layout]:
    """Every layout of ``gpus`` ranks the search considers, recompute none or full, before the rules (those
    that break one are filtered by :func:`configure`). Per pipeline shape, layouts come in order of falling
    microbatch count, so each (tp, cp, ep, ZeRO stage) meets its micro-batches smallest first and layouts that
    share a schedule come together. tp above ``max_tp`` only when --layout fixes it; cp and its mode as
    :func:`_context` gives them; ep over the divisors of dp that divide model.moe.experts (1 for a dense model)."""
    layers, batch = base.model.layers, base.train.global_batch
    experts = base.model.moe.experts
    want = lambda key, value: key not in fixed or fixed[key] == value  # noqa: E731
    for pp in divisors(gpus):
        shapes = [(tp, cp, mode, gpus // (tp * pp * cp)) for tp in divisors(gpus // pp)
                  if tp <= max_tp or "tp" in fixed for cp, mode in _context(base, tp, gpus // (tp * pp), fixed)]
        shapes = [(tp, cp, mode, dp) for tp, cp, mode, dp in shapes
                  if want("tp", tp) and want("dp", dp) and batch % dp == 0]
        if pp > layers or not want("pp", pp) or not shapes:
            continue
        shapes = [(tp, cp, mode, dp, ep) for tp, cp, mode, dp in shapes for ep in _expert_parallel(dp, experts)
                  if want("ep", ep)]
        rows = [(shape, mb) for shape in shapes
                for mb in ([fixed["micro_batch"]] if "micro_batch" in fixed
                           else _spread(divisors(batch // shape[3]), MAX_MICRO_BATCHES))]
        rows.sort(key=lambda row: -(batch // (row[0][3] * row[1])))  # stable: ties keep tp order
        for schedule, v in _pipelines(pp, layers, fixed):
            for (tp, cp, mode, dp, ep), mb in rows:
                for zero in (z for z in ZERO_ORDER if want("zero_stage", z)):
                    for rec in ([fixed["recompute"]] if "recompute" in fixed else ["none", "full"]):
                        yield Layout(tp, pp, dp, v, schedule, zero, mb, rec, ep, cp, mode)


def _context(base: Config, tp: int, ranks: int, fixed: dict) -> list[tuple[int, str]]:
    """(cp, cp_mode) pairs for ``ranks`` = dp x cp ranks at this tp: cp 1, and powers of two dividing them
    that leave a rank MIN_CP_TOKENS of a sequence, each in the modes the runtime's rules accept there
    (megazero.config.context_rules: seq_len in 2cp chunks; Ulysses splits each tp rank's heads over cp). A cp
    that --layout fixes is offered in every mode and meets the rules in configure, which say why they refuse it."""
    seq = base.model.seq_len
    if "cp" in fixed:
        sizes = [fixed["cp"]] if ranks % fixed["cp"] == 0 else []
    else:
        sizes = [1] + [2 ** i for i in range(1, ranks.bit_length())
                       if ranks % 2 ** i == 0 and seq // 2 ** i >= MIN_CP_TOKENS]
    out = []
    for cp in sizes:
        for mode in (choices("parallel", "cp_mode") if cp > 1 else ("ring",)):
            if "cp_mode" in fixed and fixed["cp_mode"] != mode:
                continue
            if cp > 1 and "cp" not in fixed:  # the runtime's rules, on a copy (a fixed cp meets them in full)
                probe = copy.copy(base)
                probe.parallel = copy.copy(base.parallel)
                probe.parallel.tp, probe.parallel.cp, probe.parallel.cp_mode = tp, cp, mode
                try:
                    check_context(probe)
                except UserError:
                    continue
            out.append((cp, mode))
    return out


def _expert_parallel(dp: int, experts: int) -> list[int]:
    """The ep sizes of a dp: those dividing both dp and the expert count; 1 without experts."""
    return [ep for ep in divisors(dp) if experts and experts % ep == 0] if experts else [1]


def _pipelines(pp: int, layers: int, fixed: dict) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs: one chunk per rank, or 2, 4, 8... chunks interleaved while every
    virtual stage keeps a layer. Without a pipeline only 1f1b (every schedule is the same there)."""
    if "schedule" in fixed:
        names = [fixed["schedule"]]
    else:
        names = ["1f1b"] if pp == 1 else list(SEARCHED_SCHEDULES)
    out = []
    for name in names:
        if name != "interleaved":
            out.append((name, 1))
            continue
        chunks = [fixed["virtual_stages"]] if "virtual_stages" in fixed else \
            [2 ** i for i in range(1, 32) if pp * 2 ** i <= layers]
        out += [(name, v) for v in chunks]
    return [(s, v) for s, v in out if "virtual_stages" not in fixed or fixed["virtual_stages"] == v]


def plan_work(layout: Layout, microbatches: int) -> int:
    """The work of planning a layout, in MAX_SEARCH_WORK's units: its stages, and the virtual microbatches of
    the schedule each walks for the activation peak."""
    listed = peak_microbatches(layout.schedule, layout.pp, microbatches, layout.virtual_stages)
    return layout.pp * (STAGE_WORK + layout.virtual_stages * listed)


def too_large(gpus: int, fixed: dict, what: str) -> UserError:
    """The one line for a search that would take minutes."""
    pinned = f" with --layout {','.join(f'{k}={v}' for k, v in fixed.items())}" if fixed else ""
    return UserError(f"the search of {gpus} GPUs{pinned} is too large to answer in seconds ({what}); fix more "
                     "knobs with --layout, e.g. pp=, tp=, cp= or micro_batch=")


def bounded(layouts: Iterator[Layout], gpus: int, fixed: dict, batch: int) -> list[Layout]:
    """The layouts, listed; a UserError at once when there are more than MAX_LAYOUTS, or when planning each once
    would pass MAX_LISTED_WORK (``batch``: train.global_batch, which gives each its microbatch count)."""
    out, work = [], 0
    for lay in layouts:
        if len(out) == MAX_LAYOUTS:
            raise too_large(gpus, fixed, f"over {MAX_LAYOUTS:,} layouts")
        work += plan_work(lay, max(1, batch // (lay.micro_batch * lay.dp)))
        if work > MAX_LISTED_WORK:
            raise too_large(gpus, fixed, f"planning its layouts once passes {MAX_LISTED_WORK:,} units of work")
        out.append(lay)
    return out

"""The command line of the layout search: ``python -m megazero.plan --config C --cluster K --gpus N``.

Reads the options, runs megazero.plan.search.search, prints the ranked table (or ``--json``) beside the config's
own layout, and ``--write`` saves the winner as a config that pretrain.py accepts. Bad input is one line,
exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from megazero.config.load import load_config
from megazero.config.ranges import MAX_WORLD
from megazero.config.resolve import resolve
from megazero.config.schema import AUTO, Config
from megazero.errors import UserError, shown, shown_name
from megazero.plan.cluster import Cluster, load_cluster
from megazero.plan.layouts import Layout, Ranked, parse_layout
from megazero.plan.search import GB, MEMORY_MARGIN, PLANNED_DEVICE, Search, configure, search
from megazero.plan.stage_plan import make_plan
from megazero.plan.step_time import step_time


def own_layout(cfg: Config, gpus: int) -> Layout:
    """The layout a resolved config runs with, in the search's terms."""
    p, m = cfg.parallel, cfg.model
    rec = "none" if not m.activation_checkpointing else str(m.checkpoint_layers) if m.checkpoint_layers else "full"
    return Layout(p.tp, p.pp, p.dp, p.virtual_stages, p.schedule, cfg.zero.stage, cfg.train.micro_batch, rec, p.ep,
                  p.cp, p.cp_mode if p.cp > 1 else "ring")


def write_config(base: Config, layout: Layout, gpus: int, path: str) -> None:
    """Save the config with ``layout`` as YAML that pretrain.py --config accepts, and load it back to prove it."""
    import yaml

    cfg = configure(base, layout, gpus)
    data = cfg.to_dict()
    data.pop("name", None)  # the name comes from the file's
    data["parallel"]["pp_layers"] = AUTO
    data["zero"]["reshard_after_forward"] = base.zero.reshard_after_forward
    data["kernels"] = dataclasses.asdict(base.kernels)  # as asked: the machine that runs it resolves them
    if data["log"]["dir"] == f"runs/{base.name}":  # the default: runs/<the new file's name>
        data["log"]["dir"] = ""
    text = f"# {base.source} laid out for {gpus} GPUs by python -m megazero.plan\n" + \
        yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    write_new(path, text)
    back = resolve(load_config(path), gpus, PLANNED_DEVICE, planned=True)
    if own_layout(back, gpus) != layout:
        raise UserError(f"--write {path}: the saved config reads back as {own_layout(back, gpus).label()}")


def write_new(path: str, text: str) -> None:
    """``text`` as a new file at ``path``, whole or not at all: written and synced beside it, then linked into
    place, which fails when the name exists (a file this did not write is never replaced). A full disk, a
    missing folder or a name the system refuses is one line, and leaves no partial or empty file."""
    where = shown_name(path)
    target = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name[:64]}.", suffix=".tmp")
    except (OSError, ValueError) as e:
        raise UserError(f"--write {where}: cannot write it ({_reason(e)})") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except OSError as e:
            if e.errno not in _NO_HARD_LINKS:
                raise
            if os.path.lexists(path):  # a file system without hard links: the check and the rename in two steps
                raise FileExistsError(path) from None
            os.rename(tmp, path)
    except FileExistsError:
        raise UserError(f"--write {where}: already exists; give a new file name (an existing file is never "
                        "replaced)") from None
    except OSError as e:
        raise UserError(f"--write {where}: cannot write it ({_reason(e)}); nothing was written") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


_NO_HARD_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS)


def _reason(e: Exception) -> str:
    return e.strerror if isinstance(e, OSError) and e.strerror else str(e)


def _cp(lay: Layout) -> str:
    return f"{lay.cp} {'a2a' if lay.cp_mode == 'all_to_all' else 'ring'}" if lay.cp > 1 else "1"


def _row(rank: str, r: Ranked, experts: bool, context: bool = False) -> str:
    lay = r.layout
    return (f"{rank:>4} {lay.tp:>4} {lay.pp:>4} {lay.dp:>5} " + (f"{lay.ep:>4} " if experts else "")
            + (f"{_cp(lay):>7} " if context else "")
            + f"{lay.virtual_stages:>3} {lay.schedule:>11} "
            f"{lay.zero_stage:>4} {lay.micro_batch:>4} {lay.recompute:>9} {r.memory_gb:>9.3g} {r.step_s:>8.4g} "
            f"{r.tflops_per_gpu:>8.1f} {r.mfu * 100:>5.1f}%")


def format_table(found: Search, own: "Ranked | str", top: int, header: str, experts: bool = False) -> str:
    """The best ``top`` layouts, then the config's own (a row, or why it cannot run here); an ep column for a
    mixture of experts, a cp column (its size and mode) where a row splits its sequences."""
    rows = found.ranked[:top] + ([own] if isinstance(own, Ranked) else [])
    context = any(r.layout.cp > 1 for r in rows)
    lines = [header, f"{'':>4} {'tp':>4} {'pp':>4} {'dp':>5} " + (f"{'ep':>4} " if experts else "")
             + (f"{'cp':>7} " if context else "")
             + f"{'v':>3} {'schedule':>11} {'zero':>4} {'mb':>4} "
               f"{'recompute':>9} {'memory GB':>9} {'step s':>8} {'TFLOP/s':>8} {'MFU':>6}"]
    lines += [_row(f"{i + 1}", r, experts, context) for i, r in enumerate(found.ranked[:top])]
    lines.append(_row("own", own, experts, context) if isinstance(own, Ranked) else f" own  {own}")
    return "\n".join(lines)


def _own(path: str, sets: list[str], cluster: Cluster, gpus: int) -> "Ranked | str":
    """The config's own layout costed as the search costs one, or the one line that says why it cannot run."""
    try:
        cfg = resolve(load_config(path, sets), gpus, PLANNED_DEVICE, planned=True)
    except UserError as e:
        return f"not valid on {gpus} GPUs: {e}"
    plan = make_plan(cfg)
    st, layout = step_time(cfg, cluster, plan=plan), own_layout(cfg, gpus)
    achieved = plan.flops_per_step / (st.total * gpus) / 1e12
    row = Ranked(layout, st.memory_bytes / GB, st.total, achieved, achieved / cluster.peak_tflops)
    budget = cluster.memory_gb * MEMORY_MARGIN
    return row if row.memory_gb <= budget else f"{layout.label()}: needs {row.memory_gb:.1f} GB, over {budget:.1f} GB"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's usage and exit become our one line
        raise UserError(f"python -m megazero.plan: {message}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = _Parser(prog="python -m megazero.plan", description="rank the layouts of a config on a cluster")
    ap.add_argument("--config", required=True, help="YAML run description, e.g. configs/gpt13b.yaml")
    ap.add_argument("--cluster", required=True, help="a name under configs/clusters (h100-80g) or a .yaml path")
    ap.add_argument("--gpus", required=True, type=int, help="GPUs the run gets")
    ap.add_argument("--global-batch", type=int, help="sequences per step (overrides train.global_batch)")
    ap.add_argument("--top", type=int, default=5, help="layouts to print (default 5)")
    ap.add_argument("--layout", default="", help="knobs to fix, e.g. tp=8,pp=4,recompute=full")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config value")
    ap.add_argument("--json", action="store_true", help="print the ranked layouts as a JSON list")
    ap.add_argument("--write", metavar="OUT.yaml", help="save the config with the best layout")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> Search:
    """The CLI's work; every input error is a UserError."""
    start = time.perf_counter()
    if not 1 <= args.gpus <= MAX_WORLD:  # the world sizes a run accepts (parallel.world_size)
        raise UserError(f"--gpus {shown(args.gpus)} is invalid; expected a GPU count from 1 to {MAX_WORLD}")
    if args.top < 1:
        raise UserError(f"--top {shown(args.top)} is invalid; expected >= 1")
    if args.write and os.path.lexists(args.write):  # said before the search, and again when linking it in
        raise UserError(f"--write {shown_name(args.write)}: already exists; give a new file name (an existing file "
                        "is never replaced)")
    fixed = parse_layout(args.layout) if args.layout else {}
    cluster = load_cluster(args.cluster)
    sets = list(args.set) + ([f"train.global_batch={args.global_batch}"] if args.global_batch is not None else [])
    try:
        base = load_config(args.config, sets)
    except UserError:  # the config's own layout may be what is invalid (micro_batch against the batch, ...)
        base = load_config(args.config, sets + ["parallel.tp=1", "parallel.pp=1", "parallel.dp=auto",
                                                "parallel.virtual_stages=1", "parallel.schedule=1f1b",
                                                "parallel.pp_layers=auto", "train.micro_batch=1", "parallel.ep=1",
                                                "parallel.cp=1"])
    found = search(base, cluster, args.gpus, fixed)
    if not found.ranked:
        raise UserError(_nothing_fits(found, cluster, args.gpus, fixed))
    if args.write:
        write_config(base, found.ranked[0].layout, args.gpus, args.write)
    if args.json:
        print(json.dumps([r.as_dict() for r in found.ranked[:args.top]], indent=1))
        return found
    header = (f"{base.name} on {args.gpus} x {cluster.name} ({cluster.memory_gb:g} GB, {MEMORY_MARGIN:.0%} "
              f"planned at most): {len(found.ranked)} of {found.costed} costed layouts fit "
              f"({time.perf_counter() - start:.1f} s)")
    print(format_table(found, _own(args.config, sets, cluster, args.gpus), args.top, header,
                       experts=base.model.moe.experts > 0))
    if args.write:
        print(f"wrote {args.write} ({found.ranked[0].layout.label()})")
    return found


def _nothing_fits(found: Search, cluster: Cluster, gpus: int, fixed: dict) -> str:
    """Why no layout came back, and what would help: more GPUs, or the memory knobs --layout pinned."""
    pinned = f" with --layout {','.join(f'{k}={v}' for k, v in fixed.items())}" if fixed else ""
    if not found.tried:
        return (f"no layout of {gpus} GPUs{pinned}: tp*pp*dp*cp must be {gpus} with pp <= model.layers, dp "
                f"dividing train.global_batch and model.seq_len divisible by 2*cp")
    if found.least is None:
        why = f" (e.g. {found.first_refusal})" if found.first_refusal else ""
        return f"no layout of {gpus} GPUs{pinned} passes the config rules{why}"
    helps = [h for knob, h in (("micro_batch", "a smaller micro-batch"), ("recompute", "recompute"), ("ep", "more ep"),
                               ("zero_stage", "ZeRO-3"), ("tp", "more tp"), ("pp", "more pp")) if knob in fixed]
    need, layout = found.least
    return (f"no layout fits {gpus} x {cluster.name}{pinned}: the least memory a valid one plans is "
            f"{need / GB:.1f} GB ({layout.label()}), over {cluster.memory_gb * MEMORY_MARGIN:.1f} GB; "
            f"try {', '.join(helps + ['more GPUs'])}")


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m megazero.plan``: 0, or 2 with one line on stderr for any input error."""
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except UserError as e:
        line = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in str(e))
        print(f"error: {line}", file=sys.stderr, flush=True)
        return 2
    return 0

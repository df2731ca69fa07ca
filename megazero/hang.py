"""Who a hung run waits on: each rank's record of its last operations, and one summary over them.

When a collective or a transfer waits past ``launch.timeout_minutes``, every rank that can still speak writes
``log.dir/hang/rank_<r>.json``: the step, the pipeline action, the last operations it issued
(``parallel.op_log``) and the error. It then waits a short grace for the others' records; the first rank to
claim ``hang/summary.txt`` writes the summary there and prints it. The summary names the ranks that wrote no
record (stopped, or gone), and for each group some rank waits in, the operation, the ranks waiting and the
members that never issued it. ``python -m megazero.hang LOG_DIR`` prints it again from the records. A run
that starts in a ``log.dir`` holding an earlier hang's folder moves it to ``hang.<n>`` first (:func:`set_aside`).

That is gloo's picture (CPU runs). On NCCL the watchdog ends a hung process itself; torch's flight recorder is
switched on there (``megazero.launch``), and its dumps land beside the records as ``hang/nccl_trace_rank_<r>``
(read them with ``torch.distributed.flight_recorder``'s ``fr_trace``); the summary points at them.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

FOLDER, SUMMARY = "hang", "summary.txt"
MAX_RECORD_BYTES = 1 << 20  # a record is a few KB; a crafted one is not read past this


def set_aside(log_dir: str | Path) -> Optional[Path]:
    """Rank 0, as a run starts: an earlier run's (or attempt's) ``hang`` folder moves to ``hang.<n>``, kept, so
    this run's records and summary are its own (a stale ``summary.txt`` would otherwise claim the next one)."""
    folder = Path(log_dir) / FOLDER
    if not folder.is_dir() or folder.is_symlink():
        return None
    n = 1
    while os.path.lexists(folder.parent / f"{FOLDER}.{n}"):
        n += 1
    try:
        os.rename(folder, folder.parent / f"{FOLDER}.{n}")
    except OSError:  # a folder that cannot be moved: this run's records join it (the summary may then be stale)
        return None
    return folder.parent / f"{FOLDER}.{n}"


def write_record(log_dir: str | Path, rank: int, world: int, ops: Any, error: str) -> Path:
    """This rank's record (``ops``: the grid's ``parallel.op_log.OpLog``), written whole or not at all."""
    folder = Path(log_dir) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "world": world, "step": ops.step, "action": ops.action, "ops": ops.record(),
              "error": error[:500]}
    path = folder / f"rank_{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)
    return path


def read_records(log_dir: str | Path) -> dict[int, dict]:
    """The records in ``log_dir/hang`` by rank; files that are not a record are left out."""
    out = {}
    for path in sorted((Path(log_dir) / FOLDER).glob("rank_*.json")):
        try:
            if path.stat().st_size > MAX_RECORD_BYTES:
                continue
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and _is_int(record.get("rank")) and isinstance(record.get("ops"), list):
            record["ops"] = [op for op in record["ops"] if _is_op(op)]  # a damaged entry is left out, not trusted
            out[record["rank"]] = record
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_op(op: Any) -> bool:
    return isinstance(op, dict) and _is_int(op.get("seq")) and all(isinstance(op.get(k), str) for k in
                                                                   ("kind", "group", "tag", "state")) \
        and isinstance(op.get("members"), list) and all(_is_int(m) for m in op["members"]) \
        and (op.get("peer") is None or _is_int(op.get("peer")))


def _waiting_on(record: dict) -> Optional[dict]:
    """The operation a rank hangs in: its blocking call that never returned, else (a pipeline transfer, waited
    by the caller) the last transfer of the action it waits for."""
    ops = record["ops"]
    for op in reversed(ops):
        if op.get("state") == "posted":
            return op
    action = str(record.get("action", ""))
    if action.startswith("wait "):
        posted = action[len("wait "):]
        transfers = [op for op in ops if op.get("action") == posted and op.get("kind") in ("send", "recv")]
        if transfers:
            return transfers[-1]
    return ops[-1] if ops else None


def _describe(op: dict) -> str:
    if op.get("kind") in ("send", "recv"):
        way = "to" if op["kind"] == "send" else "from"
        return f"{op['kind']} of {op.get('tag')} {way} rank {op.get('peer')} (action {op.get('action') or '?'})"
    return f"{op.get('kind')} tag {op.get('tag')} (its operation #{op.get('seq')} on the group)"


def _issued(record: dict, op: dict) -> Optional[int]:
    """How many operations ``record``'s rank issued on ``op``'s group, if its log reaches back that far."""
    same = [o["seq"] for o in record["ops"] if o["group"] == op["group"] and o["members"] == op["members"]]
    return max(same) if same else None


def summarize(records: dict[int, dict], world: Optional[int] = None) -> list[str]:
    """The summary's lines: the ranks without a record, then one line per operation some rank waits in."""
    if not records:
        return ["hang: no rank wrote a record"]
    world = world or max(int(r.get("world", 0)) for r in records.values()) or max(records) + 1
    missing = [r for r in range(world) if r not in records]
    lines = []
    if missing:
        lines.append(f"hang: rank{'s' if len(missing) > 1 else ''} {','.join(map(str, missing))} wrote no record "
                     f"(stopped, or gone before the timeout); the other {len(records)} of {world} did")
    else:
        lines.append(f"hang: all {world} ranks wrote a record: each waits on another (below)")
    waits: dict[tuple, list[int]] = {}
    ops: dict[tuple, dict] = {}
    for rank in sorted(records):
        op = _waiting_on(records[rank])
        if op is None:
            continue
        key = (op.get("group"), tuple(op.get("members") or ()), op.get("kind"), op.get("tag"),
               op.get("seq") if op.get("kind") not in ("send", "recv") else op.get("peer"))
        waits.setdefault(key, []).append(rank)
        ops[key] = op
    for key, ranks in waits.items():
        op, members = ops[key], list(key[1])
        who = f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}"
        where = f"{op.get('group')} group [{','.join(map(str, members))}]"
        step = records[ranks[0]].get("step")
        line = f"{where}: {who} wait{'' if len(ranks) > 1 else 's'} on {_describe(op)} at step {step}"
        if op.get("kind") in ("send", "recv"):
            others = [op.get("peer")]
        else:
            others = [m for m in members if m not in ranks]
        blame = []
        for m in others:
            if m not in records:
                blame.append(f"rank {m} wrote no record")
                continue
            issued = _issued(records[m], op)
            theirs = _waiting_on(records[m])
            said = f"rank {m} is at step {records[m].get('step')}, in {records[m].get('action') or 'no action'}"
            if theirs is not None:
                said += f", waiting on {theirs.get('group')}: {_describe(theirs)}"
            if issued is not None and op.get("kind") not in ("send", "recv") and issued < op.get("seq", 0):
                said += f" (it issued #{issued} on this group, not #{op.get('seq')})"
            blame.append(said)
        lines.append(line + ("; " + "; ".join(blame) if blame else ""))
    return lines


def nccl_dumps(log_dir: str | Path) -> list[Path]:
    return sorted((Path(log_dir) / FOLDER).glob("nccl_trace_rank_*"))


def report(log_dir: str | Path, rank: int, world: int, grace_s: float) -> Optional[list[str]]:
    """After this rank wrote its record: wait up to ``grace_s`` for every rank's; the one rank that then
    claims ``hang/summary.txt`` gets the summary's lines (written there too), the others None."""
    deadline = time.monotonic() + grace_s
    while len(read_records(log_dir)) < world and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        fd = os.open(Path(log_dir) / FOLDER / SUMMARY, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return None
    lines = summarize(read_records(log_dir), world)
    dumps = nccl_dumps(log_dir)
    if dumps:
        lines.append(f"NCCL flight recorder dumps: {dumps[0].parent}/nccl_trace_rank_* ({len(dumps)})")
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m megazero.hang LOG_DIR  (the run's log.dir, holding hang/rank_*.json)",
              file=sys.stderr)
        return 2
    records = read_records(argv[0])
    if not records:
        print(f"error: {argv[0]}: no hang records (hang/rank_*.json) to read", file=sys.stderr)
        return 2
    lines = summarize(records)
    dumps = nccl_dumps(argv[0])
    if dumps:
        lines.append(f"NCCL flight recorder dumps: {dumps[0].parent}/nccl_trace_rank_* ({len(dumps)})")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

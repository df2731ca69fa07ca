"""gpu_checks.py's long-run section: what keeps a run safe for weeks, on the device it will run on.

- a diverging bf16 run (train.lr=1e6) stops with exit 3 and one line, and its newest checkpoint is finite;
- SIGTERM mid-run finishes the step, saves it and exits 143 with one line;
- asynchronous saves (train.async_save) give the synchronous run's losses and checkpoints, tensor for tensor;
- a model too big for the device is refused before anything is built, with the device's free memory.

``lean`` (gpu_checks.py --smoke --lean, the test suite's run) runs the last check only: the test suite makes the
other three in-process (tests/train/test_hostile_run.py: a diverging bf16 run, a stop signal; tests/train/
test_train.py: asynchronous saves equal synchronous ones).
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from bench/gpu_checks.py, whose own folder is first on the path
    sys.path.insert(0, str(ROOT))


def _cmd(sets: list[str]) -> list[str]:
    cmd = [sys.executable, "pretrain.py", "--config", "configs/tiny.yaml"]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def _logged(checks, name: str, proc_out: str, proc_err: str, code) -> None:
    with open(checks.log_path, "a") as log:
        log.write(f"\n===== {name}: exit {code}\n{proc_out}{proc_err}")


def _run(checks, name: str, sets: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess | None:
    left = min(timeout, checks.deadline - time.monotonic() - 5)
    if left < 10:
        checks.fail(f"{name}: not run, the time budget is spent")
        return None
    try:
        proc = subprocess.run(_cmd(sets), cwd=ROOT, env=env, capture_output=True, text=True, timeout=left)
    except subprocess.TimeoutExpired as e:
        _logged(checks, name, str(e.stdout or ""), str(e.stderr or ""), "timeout")
        checks.fail(f"{name}: stopped after {left:.0f} s")
        return None
    _logged(checks, name, proc.stdout, proc.stderr, proc.returncode)
    return proc


def _lines(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.strip()]


def long_run_checks(checks, base: list[str], env: dict, runs: Path, lean: bool = False) -> None:
    """``base``: the overrides of a small one-device run (device, sizes, no evaluation); ``lean``: the refusal
    of a model too big only."""
    if not lean:
        _stop_and_save_checks(checks, base, env, runs)
    else:
        checks.note("- skipped (--lean): diverging bf16 run, SIGTERM mid-run, async saves equal sync saves")
    # 4. a model too big for the device
    proc = _run(checks, "model too big", base + ["model.layers=64", "model.hidden=16384", "model.heads=128",
                                                 f"log.dir={runs / 'big'}"], env, 60)
    if proc is not None:
        err = _lines(proc.stderr)
        checks.verdict(proc.returncode == 2 and len(err) == 1 and "GB is free" in err[0],
                       f"model too big: exit {proc.returncode}: {err[0][:220] if err else ''}")


def _stop_and_save_checks(checks, base: list[str], env: dict, runs: Path) -> None:
    """Checks 1-3: divergence, SIGTERM, asynchronous saves."""
    from megazero.checkpoint import store as checkpoint

    # 1. divergence: stop before saving; the newest checkpoint is finite
    log = runs / "diverge"
    proc = _run(checks, "diverging bf16 run", base + ["train.precision=bf16", "train.lr=1e6", "train.min_lr=0",
                                                      "train.steps=30", "train.save_every=1", f"log.dir={log}"],
                env, 120)
    if proc is not None:
        err = _lines(proc.stderr)
        latest = checkpoint.latest_checkpoint(log / "checkpoints")
        finite = latest is not None and all(bool(t.isfinite().all())
                                            for t in checkpoint.read_model_state(latest).values())
        checks.verdict(proc.returncode == 3 and len(err) == 1 and "stopped before saving" in err[0] and finite,
                       f"diverging bf16 run: exit {proc.returncode}, {len(err)} stderr line(s) "
                       f"({err[0][:120] if err else ''}); newest checkpoint {latest.name if latest else None} "
                       f"finite: {finite}")
    # 2. SIGTERM mid-run: the step reached is saved, exit 143
    log = runs / "sigterm"
    left = checks.deadline - time.monotonic() - 5
    if left < 20:
        checks.fail("SIGTERM run: not run, the time budget is spent")
    else:
        proc = subprocess.Popen(_cmd(base + ["train.steps=100000", f"log.dir={log}"]), cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + min(left - 15, 120)
        metrics = log / "metrics.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.is_file() and any(json.loads(x)["step"] >= 3 for x in metrics.read_text().splitlines()
                                         if x.endswith("}")):
                break
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        _logged(checks, "SIGTERM run", out, err, proc.returncode)
        stopped = [x for x in out.splitlines() if x.startswith("stopped: ")]
        latest = checkpoint.latest_checkpoint(log / "checkpoints")
        reached = stopped[0].split("step ")[1].split(":")[0] if stopped else "?"
        checks.verdict(proc.returncode == 143 and len(stopped) == 1 and not err.strip() and latest is not None
                       and latest.name == f"step_{int(reached) if reached.isdigit() else -1:08d}",
                       f"SIGTERM mid-run: exit {proc.returncode}, '{stopped[0][:100] if stopped else ''}', latest "
                       f"{latest.name if latest else None}")
    # 3. asynchronous saves equal synchronous ones
    results: dict = {}
    for mode in ("false", "true"):
        log = runs / f"async-{mode}"
        proc = _run(checks, f"saves async={mode}", base + ["train.steps=6", "train.save_every=2", "train.keep_last=3",
                                                           f"train.async_save={mode}", f"log.dir={log}"], env, 120)
        results[mode] = proc  # not run (None, reported by _run), or failed: the process
        if proc is not None and proc.returncode == 0:
            losses = [json.loads(x)["loss"] for x in (log / "metrics.jsonl").read_text().splitlines()]
            states = [checkpoint.read_model_state(p) for p in checkpoint.list_checkpoints(log / "checkpoints")]
            results[mode] = (losses, states)
    if all(isinstance(r, tuple) for r in results.values()):
        (la, sa), (lb, sb) = results["false"], results["true"]
        same = la == lb and len(sa) == len(sb) == 3 and all(
            a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a) for a, b in zip(sa, sb))
        checks.verdict(same, f"async saves equal sync saves: losses {'equal' if la == lb else 'differ'}, "
                             f"{len(sb)} checkpoints compared tensor for tensor")
    elif any(isinstance(r, subprocess.CompletedProcess) for r in results.values()):
        checks.fail("async saves: a run failed (see log.txt)")

"""Every check that needs a CUDA GPU, in one run: for a session that has one GPU for a few minutes.

0. ``bench/mfu.py --compile``: one step of a Llama-3-shaped model (hidden 2048, 16 layers, vocab 128256, seq
   4096, bf16) against the torchtitan-style peer, eager and compiled: tokens/s, MFU and the ratios.
1. ``bench/kernels.py``: attention and AdamW kernel tables, bf16 errors, and the kernel targets.
2. Training on the GPU, one process (configs/tiny.yaml at tp = pp = dp = 1, bf16):
   - ``torch``: kernels.attention = kernels.adam = torch (SDPA, torch AdamW), the reference curve;
   - ``triton``: both Triton kernels; its loss must follow ``torch``'s (bf16 tolerance below);
   - ``offload``: ``triton`` with ZeRO-1's optimizer states in pinned CPU memory (stepped by torch
     there); its loss must follow ``triton``'s;
   - ``zero3``: ``triton`` under ZeRO-3 (parameters created bucket by bucket) with parameters and
     optimizer states offloaded, writing the pipeline trace (CUDA-event timings); its loss must
     follow ``triton``'s, and the trace must hold positive durations.
3. Throughput of a GPT-2-small-shaped model (12 layers, hidden 768, seq 1024, the tiny vocabulary)
   with the torch kernels and with the Triton kernels: tokens/s and MFU (medians of 6 windows of 10 steps
   after a first window of warm-up and autotuning), and their ratio.
4. ``bench/step_profile.py``: the same model's step per kernel set, the device's busy time against the
   wall and the kernels that take it.
5. Long-run safety on the device (``bench/gpu_long_run.py``): a diverging bf16 run stops with exit 3 before
   saving, SIGTERM saves the step reached and exits 143, asynchronous saves equal synchronous ones, and a
   model too big for the device is refused with its free memory.
6. ``bench/offload_overlap.py``: with the optimizer offloaded, the gradients' copies to the host overlap
   the backward (at least half the bytes land before it ends).
7. ``bench/grouped_mm.py``: a mixture of experts' grouped matmul (``torch._grouped_mm``, bf16) against the
   per-expert loop and a padded bmm at Mixtral-, Qwen3-MoE- and DeepSeek-V3-shaped experts, forward + backward,
   ms and TFLOP/s; the results must agree with the loop's.
8. ``bench/newton_schulz.py``: Muon's Newton-Schulz iterations on a 4096 x 4096 matrix (and two MLP shapes),
   fp32 and bf16, eager and compiled, in TFLOP/s.
9. ``bench/pipeline.py``: 1F1B, zb1p and interleaved, p2p waited or overlapped, even or cost-balanced
   stages, on gloo CPU ranks (one GPU cannot hold a pipeline; the machine's cores give each rank its own).
10. ``bench/tp_overlap.py``: Domino-style tensor-parallel overlap on and off at tp = 2, on gloo CPU ranks.
11. ``bench/nvme.py``: the machine's disk (under .cache/) and the optimizer step of 100M bf16 parameters on the
    GPU with its fp32 states on that disk (``zero.offload_optimizer: nvme``) against them in host memory (``cpu``).

    python bench/gpu_checks.py [--out DIR] [--budget SECONDS] [--seqs 1024,...] [--only kernels,train,...]
                               [--smoke [--lean]]

Writes DIR/summary.md (the verdicts and figures), DIR/kernels.md (bench/kernels.py's tables),
DIR/profile.md (bench/step_profile.py's) and DIR/log.txt (every command's output), at most those four
files, as it goes: a run stopped from
outside keeps what it measured. Each command gets what is left of ``--budget`` (default 540 s, to
fit a 10-minute slot with room to copy results); a check with no time left is reported as not run.
``--smoke`` runs the same sequence on the CPU at toy sizes (the Triton kernels under the
interpreter) to check the script; ``--lean`` (with ``--smoke``, the test suite's run) leaves out what the suite
checks in-process or elsewhere in the smoke: the ZeRO-3 run (its optimizer and parameters offloaded) trains with the
torch kernels, against the torch run, and the Triton kernels' run and the optimizer-only offloaded run are left out
(tests/engine/test_kernels_training.py trains with the Triton kernels against the torch ones,
tests/parallel/test_zero.py checks offloading against the on-device runs); the throughput section times the torch
kernels alone; the environment line is not printed; and of the long-run checks only the refusal
of a model too big runs (see bench/gpu_long_run.py).
Exits 1 when a check fails or did not run, 0 otherwise; numbers are for people, the verdicts for the exit code.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# bf16 loss curves of two kernel sets: each rounds differently (~2^-8 relative per op), and 60 steps of
# training amplify that; the bf16 ZeRO tests use the same 2e-2 relative bound.
BF16_LOSS_RTOL = 2e-2
# Offloaded vs on-GPU optimizer: the same fp32 AdamW arithmetic, on the CPU by torch vs on the GPU by
# Triton (FMA contraction may differ in the last bit): fp32-level differences, amplified through bf16.
OFFLOAD_LOSS_RTOL = 2e-2
SECTIONS = ("mfu", "kernels", "train", "throughput", "profile", "longrun", "offload", "grouped_mm", "newton_schulz",
            "pipeline", "tp_overlap", "nvme")
TINY_1GPU = ["parallel.tp=1", "parallel.sequence_parallel=false", "parallel.pp=1", "parallel.dp=1",
             "train.eval_every=0", "log.tensorboard=false", "train.precision=bf16"]
GPT2_SMALL_BODY = ["model.layers=12", "model.hidden=768", "model.heads=12", "model.seq_len=1024",
                   "train.global_batch=16", "train.micro_batch=16"]


class Checks:
    """Runs commands within a time budget; their output goes to one log, the verdicts to a summary that is
    rewritten after every check."""

    def __init__(self, out: Path, title: str, budget: float):
        self.out, self.title = out, title
        self.deadline = time.monotonic() + budget
        self.log_path = out / "log.txt"
        self.log_path.write_text("")
        self.lines: list[str] = []
        self.failed: list[str] = []

    def run(self, name: str, cmd: list[str], env: dict, stdout: Path | None = None) -> str | None:
        """Run one command until it ends or the budget does; stderr (and stdout, unless it goes to ``stdout``)
        is appended to the log as it is written. Returns stdout, or None if it failed or could not run."""
        left = self.deadline - time.monotonic() - 5
        if left < 15:
            return self.fail(f"{name}: not run, the time budget is spent")
        t0 = time.monotonic()
        with open(self.log_path, "a") as log:
            log.write(f"\n===== {name}: {' '.join(cmd)}\n")
            log.flush()
            with tempfile.TemporaryFile("w+") if stdout is None else open(stdout, "w+") as out:
                try:
                    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=log, text=True, timeout=left)
                    code = proc.returncode
                except subprocess.TimeoutExpired:
                    code = None
                out.seek(0)
                text = out.read()
            if stdout is None:
                log.write(text)
            log.write(f"\n===== {name}: {'timed out' if code is None else f'exit {code}'} after "
                      f"{time.monotonic() - t0:.0f} s\n")
        if code != 0:
            return self.fail(f"{name}: " + (f"stopped after {left:.0f} s, the time left" if code is None
                                            else f"exit {code} (see log.txt)"))
        return text

    def fail(self, why: str) -> None:
        self.failed.append(why)
        self.note(f"- FAILED {why}")
        return None

    def verdict(self, ok: bool, text: str) -> None:
        if ok:
            self.note(f"- ok {text}")
        else:
            self.fail(text)

    def note(self, *lines: str) -> None:
        self.lines += lines
        self._write("all checks passed so far")

    def finish(self) -> int:
        print(self._write("all checks passed"))
        return 1 if self.failed else 0

    def _write(self, passed: str) -> str:
        status = "FAILED: " + "; ".join(self.failed) if self.failed else passed
        text = f"# GPU checks ({self.title}): {status}\n\n" + "\n".join(self.lines) + "\n"
        (self.out / "summary.md").write_text(text)
        return text


def _losses(run_dir: Path) -> dict[int, dict]:
    path = run_dir / "metrics.jsonl"
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())} if path.exists() else {}


def _worst_rel(a: dict[int, dict], b: dict[int, dict]) -> float:
    steps = sorted(set(a) & set(b))
    assert steps, "no common logged steps"
    return max(abs(a[s]["loss"] - b[s]["loss"]) / abs(b[s]["loss"]) for s in steps)


def _pretrain(checks: Checks, name: str, run_dir: Path, sets: list[str], env: dict) -> dict[int, dict]:
    """Run pretrain.py on configs/tiny.yaml with these overrides; its logged metrics by step."""
    cmd = [sys.executable, "pretrain.py", "--config", "configs/tiny.yaml"]
    for s in sets + [f"log.dir={run_dir}"]:
        cmd += ["--set", s]
    checks.run(name, cmd, env)
    return _losses(run_dir)


def _training(checks: Checks, runs: Path, base: list[str], env: dict, steps: int, lean: bool = False) -> None:
    """2. Training on one device: the Triton kernels, the offloaded optimizer and ZeRO-3 against the reference
    (``lean``: the ZeRO-3 offloaded run alone, with the torch kernels, against the torch run)."""
    torch_k = ["kernels.attention=torch", "kernels.adam=torch"]
    triton_k = ["kernels.attention=triton", "kernels.adam=triton"]
    offload_k = torch_k if lean else triton_k
    ref = _pretrain(checks, "train torch kernels", runs / "torch", base + torch_k, env)
    if lean:  # tests/engine/test_kernels_training.py trains them against the torch kernels in-process
        checks.note("- skipped (--lean): triton kernels against torch kernels")
    fused = {} if lean else _pretrain(checks, "train triton kernels", runs / "triton", base + triton_k, env)
    if ref and fused:
        worst = _worst_rel(fused, ref)
        checks.verdict(worst <= BF16_LOSS_RTOL, f"triton kernels follow torch kernels over {steps} steps: worst "
                       f"relative loss difference {worst:.2e} (bound {BF16_LOSS_RTOL:g}); final loss "
                       f"{fused[max(fused)]['loss']:.4f} vs {ref[max(ref)]['loss']:.4f}")
    kset = "torch" if lean else "triton"
    # lean: the ZeRO-3 run below offloads the optimizer too (the suite checks the offloaded AdamW in-process)
    offload = {} if lean else _pretrain(checks, f"train {kset} kernels, optimizer offloaded", runs / "offload",
                                        base + offload_k + ["zero.stage=1", "zero.offload_optimizer=cpu"], env)
    zero3 = _pretrain(checks, f"train {kset} kernels, ZeRO-3, everything offloaded, traced", runs / "zero3",
                      base + offload_k + ["zero.stage=3", "zero.offload_optimizer=cpu", "zero.offload_params=cpu",
                                          "log.pipeline_trace=true"], env)
    on_device = ref if lean else fused
    for name, got in (("offloaded optimizer", offload), ("ZeRO-3 offloaded", zero3)):
        if on_device and got:
            worst = _worst_rel(got, on_device)
            checks.verdict(worst <= OFFLOAD_LOSS_RTOL, f"{name} follows the on-device run: worst relative loss "
                           f"difference {worst:.2e} (bound {OFFLOAD_LOSS_RTOL:g}); offloaded "
                           f"{got[max(got)].get('offloaded_gb', float('nan')):.3f} GB")
    trace_path = runs / "zero3" / "pipeline_trace.json"
    if trace_path.exists():
        spans = [e for e in json.loads(trace_path.read_text())["traceEvents"] if e.get("ph") == "X"]
        checks.verdict(bool(spans) and all(e["dur"] > 0 for e in spans),
                       f"pipeline trace: {len(spans)} spans, total {sum(e['dur'] for e in spans) / 1e3:.1f} ms")


def _throughput(checks: Checks, runs: Path, device: str, body: list[str], tput_steps: int, env: dict,
                lean: bool = False) -> None:
    """3. Tokens/s and MFU of a GPT-2-small shape with each kernel set (``lean``: the torch set; the training
    section's run has just trained with the Triton set through the same script)."""
    torch_k = ["kernels.attention=torch", "kernels.adam=torch"]
    triton_k = ["kernels.attention=triton", "kernels.adam=triton"]
    speed = {}
    for name, kset in (("torch", torch_k),) + ((("triton", triton_k),) if not lean else ()):
        tput = [f"launch.device={device}", f"train.steps={tput_steps}", f"log.every={max(1, tput_steps // 7)}",
                *TINY_1GPU, *body, *kset]
        metrics = _pretrain(checks, f"throughput {name} kernels", runs / f"tput-{name}", tput, env)
        timed = [r for s, r in sorted(metrics.items())][1:]  # the first interval holds compilation
        if timed:
            speed[name] = (statistics.median(r["tokens_per_s"] for r in timed),
                           statistics.median(r["mfu"] for r in timed),
                           max(r["memory_gb"] for r in timed))
    if speed:
        lines = [f"- {n} kernels: {t:,.0f} tokens/s, MFU {m:.1%}, peak memory {g:.1f} GB"
                 for n, (t, m, g) in speed.items()]
        if len(speed) == 2:
            lines.append(f"- triton / torch tokens/s: {speed['triton'][0] / speed['torch'][0]:.2f}")
        checks.note("", "Throughput, " + " ".join(body) + f" (medians of {len(timed)} windows of "
                    f"{max(1, tput_steps // 7)} steps):", *lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "runs" / "gpu-checks"))
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for everything")
    ap.add_argument("--seqs", default=None, help="attention sequence lengths for bench/kernels.py")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU: checks the script")
    ap.add_argument("--lean", action="store_true", help="with --smoke: leave out what the test suite checks "
                    "in-process or elsewhere in the smoke (the environment line, the Triton kernels' training and "
                    "throughput runs, the offloaded runs with the torch kernels and the optimizer-only one, 3 of the 4 "
                    "long-run checks)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"sections to run, of {','.join(SECTIONS)}")
    args = ap.parse_args()
    only = set(args.only.split(","))
    if not only <= set(SECTIONS):
        ap.error(f"--only {args.only!r}: valid sections are {','.join(SECTIONS)}")
    if args.lean and not args.smoke:
        ap.error("--lean: only with --smoke (a GPU run trains every run with the Triton kernels)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)
    if args.smoke:
        env["TRITON_INTERPRET"] = "1"
        device, steps, tput_steps, every = "cpu", 4, 2, 2
        # fp32: Triton's interpreter computes bf16 wrongly (a gradient norm of 1e13 where torch's is 2.4), and a CPU
        # without native bf16 runs it ~5x slower; a GPU run trains in bf16 (TINY_1GPU)
        body = ["model.layers=2", "model.hidden=64", "model.heads=1", "model.seq_len=64",
                "train.global_batch=2", "train.micro_batch=2", "train.precision=fp32", "model.vocab_size=512"]
    else:
        import torch

        if not torch.cuda.is_available():
            print("bench/gpu_checks.py needs a CUDA GPU (--smoke runs the script on the CPU)", file=sys.stderr)
            return 2
        device, steps, tput_steps, every = "cuda", 60, 70, 5
        body = GPT2_SMALL_BODY
    checks = Checks(out, "smoke, CPU" if args.smoke else device, args.budget)
    if args.lean:  # the suite's environment is its own
        checks.note("Environment: not checked (--lean)", "")
    else:
        version = checks.run("environment", [sys.executable, "-c", "import torch, triton; print('torch', "
                             "torch.__version__, 'triton', triton.__version__, 'CUDA', torch.version.cuda, "
                             "torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"], env)
        checks.note(f"Environment: {(version or '?').strip()}", "")

    if "mfu" in only:  # 0. the step against the torchtitan-style peer: the figure everything else explains
        mfu_cmd = [sys.executable, "bench/mfu.py"] + (["--toy"] if args.smoke else ["--compile"])
        mfu_md = checks.run("bench/mfu.py", mfu_cmd, env, stdout=out / "mfu.md")
        if mfu_md is not None:
            rows = [line for line in mfu_md.splitlines() if line.startswith(("## ", "|"))]
            checks.note("One training step against the torchtitan-style peer (bench/mfu.py, mfu.md):", *rows, "")
    if "kernels" in only:  # 1. kernels: tables straight into kernels.md as they are measured
        kernels_cmd = [sys.executable, "bench/kernels.py"] + (["--smoke"] if args.smoke else []) \
            + (["--seqs", args.seqs] if args.seqs else [])
        # --smoke chooses the interpreter itself (tests/bench/test_bench_kernels.py checks kernels.md)
        kernels_env = {k: v for k, v in env.items() if k != "TRITON_INTERPRET"}
        kernels_md = checks.run("bench/kernels.py", kernels_cmd, kernels_env, stdout=out / "kernels.md")
        if kernels_md is not None:
            targets = kernels_md.split("### Targets")[-1].strip().splitlines()
            checks.note("Kernel targets (bench/kernels.py):", *targets, "")
            if any(line.endswith("MISSED") and "errors" in line for line in targets):
                checks.fail("attention errors above the bar (see kernels.md)")
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(tmp)
        base = TINY_1GPU + [f"launch.device={device}", f"train.steps={steps}", f"log.every={every}"]
        if args.smoke:
            base += body
        if "train" in only:
            _training(checks, runs, base, env, steps, args.lean)
        if "throughput" in only:
            _throughput(checks, runs, device, body, tput_steps, env, args.lean)
        if "longrun" in only:
            from gpu_long_run import long_run_checks

            long_run_checks(checks, TINY_1GPU + [f"launch.device={device}", "log.every=1"]
                            + (body if args.smoke else []), env, runs, lean=args.lean)
    if "profile" in only:  # 4. where a step's time goes
        profile_cmd = [sys.executable, "bench/step_profile.py"] + (["--smoke", "--sets", "torch/torch,triton/triton"]
                                                                   if args.smoke else [])
        profile_md = checks.run("bench/step_profile.py", profile_cmd, env, stdout=out / "profile.md")
        if profile_md is not None:
            walls = [line for line in profile_md.splitlines()
                     if line.startswith(("### ", "- wall", "- device busy", "- host syncs"))]
            checks.note("", "Step profile (bench/step_profile.py, profile.md):", *walls)
    if "offload" in only:  # 6. the offloaded optimizer's copies hidden behind the backward
        offload_cmd = [sys.executable, "bench/offload_overlap.py"] + (["--smoke"] if args.smoke else [])
        lines = checks.run("bench/offload_overlap.py", offload_cmd, env)
        if lines is not None:
            checks.note("", "Offloaded gradient copies (bench/offload_overlap.py):", *lines.strip().splitlines())
    if "grouped_mm" in only:  # 7. the experts' grouped matmul against the per-expert loop
        grouped_cmd = [sys.executable, "bench/grouped_mm.py"] + (["--smoke"] if args.smoke else ["--device", "cuda"])
        lines = checks.run("bench/grouped_mm.py", grouped_cmd, env)
        if lines is not None:
            body_lines = [line for line in lines.strip().splitlines() if not line.startswith("- largest")]
            checks.note("", "Grouped matmul (bench/grouped_mm.py):", *body_lines)
            agree = [line for line in lines.splitlines() if line.startswith("- largest relative difference")]
            checks.verdict(bool(agree) and agree[0].endswith(": ok"), "grouped matmul agrees with the per-expert "
                           "loop: " + (agree[0][2:].rsplit(":", 1)[0] if agree else "no result"))
    if "newton_schulz" in only:  # 8. Muon's orthogonalisation in TFLOP/s
        ns_cmd = [sys.executable, "bench/newton_schulz.py"] + (["--smoke"] if args.smoke else ["--device", "cuda"])
        lines = checks.run("bench/newton_schulz.py", ns_cmd, env)
        if lines is not None:
            checks.note("", "Newton-Schulz (bench/newton_schulz.py):", *lines.strip().splitlines())
    if "pipeline" in only:  # 9. schedules, p2p overlap and stage balance (CPU ranks)
        pipe_cmd = [sys.executable, "bench/pipeline.py"] + (
            ["--steps", "1", "--rounds", "1", "--layers", "4", "--hidden", "32", "--seq", "16", "--vocab", "256",
             "--micro-batch", "2", "--microbatches", "2"] if args.smoke else ["--steps", "20", "--rounds", "1"])
        lines = checks.run("bench/pipeline.py", pipe_cmd, env)
        if lines is not None:
            checks.note("", "Pipeline schedules (bench/pipeline.py):", *lines.strip().splitlines())
    if "tp_overlap" in only:  # 10. tensor-parallel collectives under the other half's matmuls (CPU ranks)
        tpo_cmd = [sys.executable, "bench/tp_overlap.py"] + (
            ["--layers", "1", "--hidden", "128", "--seq", "32", "--micro-batch", "2", "--steps", "1", "--repeats", "1"]
            if args.smoke else ["--steps", "20", "--repeats", "2"])
        lines = checks.run("bench/tp_overlap.py", tpo_cmd, env)
        if lines is not None:
            checks.note("", "Tensor-parallel overlap (bench/tp_overlap.py):", *lines.strip().splitlines())
    if "nvme" in only:  # 11. ZeRO-Infinity: the optimizer's states on this machine's disk, under .cache/
        nvme_cmd = [sys.executable, "bench/nvme.py"] + (["--smoke"] if args.smoke else [
            "--device", "cuda", "--params", "100M", "--steps", "20", "--repeats", "1", "--path", str(ROOT / ".cache")])
        lines = checks.run("bench/nvme.py", nvme_cmd, env)
        if lines is not None:
            checks.note("", "Optimizer states on the disk (bench/nvme.py):", *lines.strip().splitlines())
    return checks.finish()


if __name__ == "__main__":
    sys.exit(main())

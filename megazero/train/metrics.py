"""What a run reports: throughput and MFU (from the one FLOPs formula, megazero.costs), memory, losses.

One rank writes (the one that holds the loss): a console line per log
interval, one JSON object per logged step in ``metrics.jsonl``, and the same
scalars to TensorBoard.
"""
from __future__ import annotations

import json
import math
import os
import resource
import time
from pathlib import Path
import torch


# Dense peak TFLOP/s per device, by name fragment and compute dtype (vendor data sheets).
_GPU_PEAK_TFLOPS = {
    "H200": {"bf16": 989.4, "fp32": 66.9},
    "H100": {"bf16": 989.4, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.1, "fp32": 91.6},
    "A10": {"bf16": 125.0, "fp32": 31.2},
}


def measure_cpu_tflops(dtype: torch.dtype = torch.float32, size: int = 1024, repeats: int = 4,
                       rounds: int = 3) -> float:
    """A CPU has no data-sheet peak we can trust here: measure a matmul in the run's dtype instead (CPUs with
    bf16 matrix units run bf16 several times faster than fp32), the best of a few rounds."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    a @ b
    best = math.inf
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(repeats):
            a @ b
        best = min(best, time.perf_counter() - t0)
    return 2.0 * size ** 3 * repeats / best / 1e12


def peak_tflops(device: torch.device, precision: str, configured) -> float:
    """Per-device peak for MFU: the configured number, a data-sheet value, or a measured CPU matmul."""
    if configured != "auto":
        return float(configured)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        key = "bf16" if precision in ("bf16", "fp16") else "fp32"
        for frag, peaks in _GPU_PEAK_TFLOPS.items():
            if frag in name:
                return peaks[key]
        return float("nan")
    return measure_cpu_tflops({"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32))


def memory_gb(device: torch.device) -> float:
    """Peak memory of this process: allocator peak on CUDA, max resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def _fmt_time(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


# jsonl key -> TensorBoard tag
_TB_TAGS = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s", "tflops": "perf/tflops_per_device", "mfu": "perf/mfu",
    "memory_gb": "perf/memory_gb", "val_loss": "val/loss", "val_ppl": "val/perplexity",
    "params_gb": "memory/params_gb", "grads_gb": "memory/grads_gb", "optimizer_gb": "memory/optimizer_gb",
    "offloaded_gb": "memory/offloaded_gb", "loss_scale": "train/loss_scale", "skipped": "train/skipped_steps",
}


def _tb_tag(key: str) -> str:
    """A jsonl key's TensorBoard tag: val_loss/<source> goes beside val/loss, as val/loss/<source>."""
    if key.startswith("val_loss/"):
        return "val/loss/" + key[len("val_loss/"):]
    return _TB_TAGS.get(key, f"train/{key}")


def _step_of(line: str) -> float:
    """A metrics.jsonl record's step; infinity for a line a crash cut short."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


class MetricsLogger:
    """Console + metrics.jsonl + TensorBoard, written only where `enabled` (the loss-holding rank)."""

    def __init__(self, log_dir: str | Path, total_steps: int, enabled: bool, tensorboard: bool = True,
                 append: bool = False, start_step: int = 0):
        self.enabled = enabled
        self.total_steps = total_steps
        self.dir = Path(log_dir)
        self.writer = None
        self.file = None
        self.started = time.perf_counter()
        self.start_step = start_step
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "metrics.jsonl"
        # A resume continues after its checkpoint's step: records a crashed run wrote past it are redone,
        # so they go (here, and in TensorBoard through purge_step).
        kept = [line for line in path.read_text().splitlines() if _step_of(line) <= start_step] \
            if append and path.is_file() else []
        if not append:  # a fresh run replaces the logs of one that ran here before, TensorBoard's too
            for old in self.dir.glob("events.out.tfevents.*"):
                old.unlink()
        staged = path.with_name(path.name + ".tmp")  # replaced in one step: a kill now loses no history
        staged.write_text("".join(line + "\n" for line in kept))
        os.replace(staged, path)
        self.file = open(path, "a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.dir), purge_step=start_step + 1 if append else None)

    def log(self, step: int, values: dict) -> None:
        """Record one step's metrics (step counts from 1: the number of optimizer steps done)."""
        if not self.enabled:
            return
        record = {"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                   for k, v in values.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(_tb_tag(key), value, step)
        self._console(step, values)

    def _console(self, step: int, v: dict) -> None:
        done = step - self.start_step
        elapsed = time.perf_counter() - self.started
        eta = elapsed / max(done, 1) * (self.total_steps - step)
        parts = [f"step {step}/{self.total_steps}"]
        if "loss" in v:
            parts.append(f"loss {v['loss']:.4f}")
        if "val_loss" in v:
            parts.append(f"val {v['val_loss']:.4f} (ppl {v.get('val_ppl', float('nan')):.1f})")
            per_source = [f"{k[len('val_loss/'):]} {x:.4f}" for k, x in v.items() if k.startswith("val_loss/")]
            if per_source:
                parts.append("val " + ", ".join(per_source))
        if "lr" in v:
            parts.append(f"lr {v['lr']:.2e}")
        if "grad_norm" in v:
            parts.append(f"grad {v['grad_norm']:.3f}")
        if "tokens_per_s" in v:
            parts.append(f"{v['tokens_per_s']:,.0f} tok/s")
        if "tflops" in v:
            parts.append(f"{v['tflops']:.3f} TFLOP/s")
        if "mfu" in v and math.isfinite(v["mfu"]):
            parts.append(f"mfu {100 * v['mfu']:.1f}%")
        parts.append(f"eta {_fmt_time(eta)}")
        print(" | ".join(parts), flush=True)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.writer is not None:
            self.writer.close()

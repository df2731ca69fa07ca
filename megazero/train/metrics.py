"""What a run reports: throughput and MFU (from the one FLOPs formula, megazero.costs), memory, losses.

One rank writes (the one that holds the loss): a console line per log
interval, one JSON object per logged step in ``metrics.jsonl``, and the same
scalars to TensorBoard.
"""
from __future__ import annotations

import json
import math
import resource
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from megazero.disk import replace_text, write_refusal
from megazero.errors import UserError

if TYPE_CHECKING:
    from megazero.train.events import EventFile

EVENTS = "events.out.tfevents.*"  # TensorBoard's event files (megazero.train.events writes them)


# Dense peak TFLOP/s per device, by name fragment and compute dtype (vendor data sheets).
_GPU_PEAK_TFLOPS = {
    "H200": {"bf16": 989.4, "fp32": 66.9},
    "H100": {"bf16": 989.4, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.1, "fp32": 91.6},
    "A10": {"bf16": 125.0, "fp32": 31.2},
}


def measure_cpu_tflops(dtype: torch.dtype = torch.float32, max_size: int = 1024, budget_s: float = 0.3,
                       rounds: int = 3) -> float:
    """A CPU has no data-sheet peak we can trust here: measure a matmul in the run's dtype instead (CPUs with
    bf16 matrix units run bf16 several times faster than fp32), the best throughput of a few rounds.

    The matrix doubles from 128 (up to ``max_size``) while the next size's rounds would fit ``budget_s``: a CPU
    without bf16 units emulates bf16 ~60x slower than fp32 (2.7 s for one 1024^3 product on a 2-core EPYC),
    where a fixed size made every run's start wait ~35 s. Each size is timed ``rounds`` times and the best
    throughput of any size is kept, so one product slowed by a busy machine neither stops the growth nor
    becomes the peak."""
    size, best = 128, 0.0
    while True:
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        a @ b  # warm-up: the thread pool and packing buffers
        one = math.inf
        for _ in range(rounds):
            t0 = time.perf_counter()
            a @ b
            one = min(one, max(time.perf_counter() - t0, 1e-9))
        best = max(best, 2.0 * size ** 3 / one)
        if 2 * size > max_size or 8 * one * rounds > budget_s:  # the next size costs 8x
            break
        size *= 2
    repeats = max(1, min(4, int(budget_s / (rounds * one))))
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(repeats):
            a @ b
        best = max(best, 2.0 * size ** 3 * repeats / (time.perf_counter() - t0))
    return best / 1e12


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
    if key.startswith("moe/"):  # a mixture of experts' router figures, per layer: their own section
        return key
    return _TB_TAGS.get(key, f"train/{key}")


def _step_of(line: str) -> float:
    """A metrics.jsonl record's step; infinity for a line a crash cut short."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


class MetricsLogger:
    """Console + metrics.jsonl + TensorBoard, written only where `enabled` (the loss-holding rank).

    A write the disk refuses (full, over quota, read-only) is one line (UserError) naming the file, and leaves
    no partial file of its own behind: the staged metrics.jsonl, an event file that could not be started."""

    def __init__(self, log_dir: str | Path, total_steps: int, enabled: bool, tensorboard: bool = True,
                 append: bool = False, start_step: int = 0, wandb: Optional[Callable[[], Any]] = None):
        """``wandb``: opens the W&B run that receives the same scalars (``megazero.train.wandb_log``), or None."""
        self.enabled = enabled
        self.wandb = None
        self.total_steps = total_steps
        self.dir = Path(log_dir)
        self.path = self.dir / "metrics.jsonl"
        self.writer: Optional[EventFile] = None
        self.file = None
        self.failed = False  # a write was refused and reported: closing does not report it again
        self.started = time.perf_counter()
        self.start_step = start_step
        if not enabled:
            return
        what, path, needs = "metrics", self.path, None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            # A resume continues after its checkpoint's step: records a crashed run wrote past it are redone,
            # so they go (here, and in TensorBoard through purge_step).
            kept = [line for line in self.path.read_text().splitlines() if _step_of(line) <= start_step] \
                if append and self.path.is_file() else []
            if not append:  # a fresh run replaces the logs of one that ran here before, TensorBoard's too
                for old in self.dir.glob(EVENTS):
                    old.unlink()
            text = "".join(line + "\n" for line in kept)
            needs = len(text.encode())
            replace_text(self.path, text)  # in one step: a kill now loses no history
            self.file = open(self.path, "a")
            if tensorboard:
                from megazero.train import events  # tensorboard's protos: only where they are written

                what, path, needs = "TensorBoard events", self.dir / EVENTS, None
                self.writer = events.EventFile(self.dir, purge_step=start_step + 1 if append else None)
        except OSError as e:
            raise self._refused(e, what, path, needs) from None
        if wandb is not None:
            self.wandb = wandb()

    def _refused(self, e: OSError, what: str, path: Path, needs: Optional[int]) -> UserError:
        """The one line for a write the disk refused (the files are closed: nothing more is written)."""
        self.failed = True
        self.close()
        reason = write_refusal(e, path, self.dir, needs) or f"cannot write it ({e})"
        return UserError(f"{what} {path}: {reason}")

    def log(self, step: int, values: dict) -> None:
        """Record one step's metrics (step counts from 1: the number of optimizer steps done)."""
        if not self.enabled:
            return
        record = {"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                   for k, v in values.items()}}
        line = json.dumps(record) + "\n"
        try:
            self.file.write(line)
            self.file.flush()
        except OSError as e:
            raise self._refused(e, "metrics", self.path, len(line.encode())) from None
        scalars = {_tb_tag(k): v for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self.writer is not None:
            try:
                self.writer.add_scalars(step, scalars)
            except OSError as e:
                raise self._refused(e, "TensorBoard events", self.writer.path, None) from None
        if self.wandb is not None:
            self.wandb.log(step, scalars)
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
        if "straggler/ratio" in v:  # every rank's compute time against the median: the slowest one
            parts.append(f"slowest rank {v['straggler/slowest_rank']:.0f} {v['straggler/ratio']:.2f}x")
        if "moe/load_max_over_mean" in v:  # the worst layer's expert load, the layers' mean balance loss
            parts.append(f"moe load max/mean {v['moe/load_max_over_mean']:.2f} aux {v['moe/aux_loss']:.3f}")
        parts.append(f"eta {_fmt_time(eta)}")
        print(" | ".join(parts), flush=True)

    def close(self) -> None:
        """Close both files; a refused last write is one line (unless one was reported already)."""
        file, writer, self.file, self.writer = self.file, self.writer, None, None
        if self.wandb is not None:
            wandb, self.wandb = self.wandb, None
            wandb.finish()
        try:
            if file is not None:
                file.close()
        except OSError as e:
            if not self.failed:
                if writer is not None:
                    writer.close(quiet=True)
                raise self._refused(e, "metrics", self.path, None) from None
        if writer is not None:
            try:
                writer.close(quiet=self.failed)
            except OSError as e:
                raise self._refused(e, "TensorBoard events", writer.path, None) from None


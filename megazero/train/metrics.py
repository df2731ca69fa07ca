"""What a run reports, and the one FLOPs formula behind throughput and MFU.

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

from models import arch

# Dense peak TFLOP/s per device, by name fragment and compute dtype (vendor data sheets).
_GPU_PEAK_TFLOPS = {
    "H200": {"bf16": 989.4, "fp32": 66.9},
    "H100": {"bf16": 989.4, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.1, "fp32": 91.6},
    "A10": {"bf16": 125.0, "fp32": 31.2},
}


def flops_per_token(layers: int, hidden: int, ffn_hidden: int, seq_len: int, vocab: int,
                    kv_hidden: int | None = None, mlp_matrices: int = 2) -> float:
    """Training FLOPs per token (forward + backward, no recomputation).

    6 FLOPs per matmul parameter per token (2 forward, 4 backward) plus the
    attention score and value products, 12·L·s·h (PaLM, Chowdhery et al. 2022,
    App. B). Matmul parameters per layer: the q and output projections (2h²),
    k and v (2·h·kv_hidden: h·h each for multi-head attention, kv_heads·head_dim
    columns under grouped-query attention), the MLP (mlp_matrices·h·ffn: 2 for
    GPT-2's fc1/fc2, 3 for SwiGLU's gate/up/down); and the output head (V·h).
    The layout does not change it.
    """
    kv = hidden if kv_hidden is None else kv_hidden
    matmul_params = layers * (2 * hidden * hidden + 2 * hidden * kv + mlp_matrices * hidden * ffn_hidden) \
        + vocab * hidden
    return 6.0 * matmul_params + 12.0 * layers * seq_len * hidden


def model_shape(model_cfg) -> dict:
    """The keyword arguments of :func:`flops_per_token` that depend on the architecture."""
    m = model_cfg
    return {"kv_hidden": m.kv_head_count * m.head_dim, "mlp_matrices": 3 if arch.is_llama(m) else 2}


def model_flops_per_token(model_cfg) -> float:
    m = model_cfg
    return flops_per_token(m.layers, m.hidden, arch.ffn_hidden(m), m.seq_len, m.padded_vocab, **model_shape(m))


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

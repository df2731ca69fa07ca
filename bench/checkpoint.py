"""Checkpoint stall: how long a save stops the training loop, synchronous against asynchronous.

The state is what the trainer saves for a GPT of megazero's own shapes (``build_gpt`` on the meta device
gives the names and sizes): per parameter the model copy (bf16), the fp32 master and the two fp32 Adam
moments, under the trainer's logical names, on CUDA when there is a GPU (else the CPU). Both modes go
through ``megazero.checkpoint.writer.CheckpointWriter`` into the same folder (keep_last=1):

  sync   save() returns once the checkpoint is written and committed: the whole write is the stall
  async  save() returns once the state is copied to host memory; the write goes on in a thread while a
         stand-in training loop (one matmul per step, polling the writer) runs until it is committed

Reported per mode, after one warm-up save, over --repeats saves: the median (and fastest) stall, and for
async the background write's duration (save's return to the commit) and the stand-in step's median time
during that write against its time alone (what the writer thread takes from training).

    python bench/checkpoint.py [--layers 12 --hidden 768 --vocab 50304] [--repeats 5] [--dir PATH]

Not a test: nothing here asserts.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import argparse  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from megazero.checkpoint.writer import CheckpointWriter  # noqa: E402
from megazero.config.schema import ModelConfig  # noqa: E402
from megazero.models.build import build_gpt  # noqa: E402


def trainer_state(layers: int, hidden: int, vocab: int, device: torch.device) -> dict[str, torch.Tensor]:
    """model/NAME (bf16) and optim/NAME/{master, exp_avg, exp_avg_sq} (fp32), as a run saves them
    (``megazero.train.checkpoint_state.state_tensors``)."""
    cfg = ModelConfig(layers=layers, hidden=hidden, heads=max(1, hidden // 64), seq_len=1024, vocab_size=vocab)
    shapes = {n: p.shape for n, p in build_gpt(cfg, seed=0, materialise=False).named_parameters()}
    g = torch.Generator(device=device).manual_seed(0)
    state = {}
    for name, shape in shapes.items():
        master = torch.randn(shape, generator=g, device=device)
        state[f"model/{name}"] = master.bfloat16()
        state[f"optim/{name}/master"] = master
        state[f"optim/{name}/exp_avg"] = torch.randn(shape, generator=g, device=device) * 1e-3
        state[f"optim/{name}/exp_avg_sq"] = torch.rand(shape, generator=g, device=device) * 1e-6
    return state


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class StandIn:
    """One 'training step': a matmul whose time is known, so the writer thread's toll on it shows."""

    def __init__(self, device: torch.device):
        n = 4096 if device.type == "cuda" else 384
        self.device, self.a = device, torch.randn(n, n, device=device)

    def step(self) -> float:
        t0 = time.perf_counter()
        for _ in range(8 if self.device.type == "cuda" else 1):
            self.a = torch.tanh(self.a @ self.a * 1e-2)
        _sync(self.device)
        return time.perf_counter() - t0


def run(args: argparse.Namespace) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
    state = trainer_state(args.layers, args.hidden, args.vocab, device)
    params = sum(t.numel() for k, t in state.items() if k.startswith("model/"))
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    folder = Path(args.dir or tempfile.mkdtemp(prefix="megazero-ckpt-bench-"))
    meta = {"consumed_samples": 0, "optimizer_step": 0}
    stand_in = StandIn(device)
    alone = statistics.median(stand_in.step() for _ in range(20))
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else os.cpu_count()} "
          f"{'' if device.type == 'cuda' else 'CPU cores'}), torch {torch.__version__}, {params / 1e6:.1f}M "
          f"parameters, state {nbytes / 1e9:.2f} GB in {len(state)} tensors, folder {folder}", flush=True)
    stalls: dict[str, list[float]] = {"sync": [], "async": []}
    background, during = [], []
    step = 0
    try:
        for mode in ("sync", "async"):
            writer = CheckpointWriter(folder, keep_last=1, async_save=mode == "async")
            for i in range(1 + args.repeats):  # the first is a warm-up (allocation, page cache, imports)
                step += 1
                _sync(device)
                t0 = time.perf_counter()
                writer.save(step, state, meta, "bench")
                stall = time.perf_counter() - t0
                if mode == "async":
                    times, committed = [], None
                    while committed is None:
                        times.append(stand_in.step())
                        for t in state.values():  # the optimizer moving on: the staged copy must not see it
                            t.view(-1)[:1].add_(1)
                        committed = writer.poll()
                    written = time.perf_counter() - t0 - stall
                if i:
                    stalls[mode].append(stall)
                    if mode == "async":
                        background.append(written)
                        during.append(statistics.median(times))
                print(f"  {mode} save {i}{' (warm-up)' if not i else ''}: stall {stall:.3f} s"
                      + (f", background write {written:.3f} s over {len(times)} stand-in steps" if mode == "async"
                         else ""), flush=True)
            writer.close()
    finally:
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)
    med = {m: statistics.median(v) for m, v in stalls.items()}
    print("\n| mode | stall median (s) | fastest (s) | state GB/s through the stall |\n|---|---|---|---|")
    for m in ("sync", "async"):
        print(f"| {m} | {med[m]:.3f} | {min(stalls[m]):.3f} | {nbytes / 1e9 / med[m]:.2f} |")
    print(f"\nstall ratio sync/async: {med['sync'] / med['async']:.1f}x")
    print(f"async background write: median {statistics.median(background):.3f} s "
          f"(fastest {min(background):.3f} s)")
    print(f"stand-in training step: {alone * 1e3:.1f} ms alone, {statistics.median(during) * 1e3:.1f} ms during the "
          f"background write (median of per-save medians)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", choices=("auto", "cpu"), default="auto")
    ap.add_argument("--dir", default="", help="folder to write into (default: a temporary one, removed after)")
    run(ap.parse_args())


if __name__ == "__main__":
    main()

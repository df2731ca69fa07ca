"""NVMe offload (``zero.offload_optimizer: nvme``): the disk, the streamed optimizer step, and the step with its
states in memory, measured in one run.

1. The disk under ``--path``: a sequential write and then read of ``--mb`` MB in records of the optimizer's own
   size (a chunk's master and moments), two in flight on the thread pool the optimizer uses
   (``parallel/zero/nvme_file.py``), ``O_DIRECT`` where the filesystem allows it; GB/s each way.
2. The optimizer step over ``--params`` parameters (fp32 matrices and vectors, one ZeRO bucket each, stage 0, one
   process, weight decay on the matrices), with its states
   - in memory (``zero.offload_optimizer: none``; on a CPU machine ``cpu`` is the same tensors on the same
     device, so it is the same row), and
   - on the disk (``nvme``), streamed through ``--buffer-mb`` of host buffers;

   seconds per step, the two alternating step by step, ``--steps`` timed steps after 2 warm-up steps in each of
   ``--repeats`` rounds, medians; the NVMe step's bytes read and written and its effective GB/s against part 1's.
   The rest of a training step (forward, backward, reductions) is the same whatever holds the states, so the
   optimizer step is where the two differ. With fp32 parameters on the CPU the parameters are their own masters,
   so the disk holds the two moments (8 B a parameter) and each step reads and writes them once.

3. With ``--train``: the whole training step (forward, backward, optimizer) of a Llama of 312M parameters (24 layers
   of hidden 1024) over ``--tokens`` tokens (sequences of 256), fp32, one process, its states in memory and on
   the disk, alternating step by step as above: where the forward and backward take seconds, the disk's time is
   a share of the step, not a multiple of it. The two runs' losses are compared (they are bit for bit equal).

    python bench/nvme.py --path /local/nvme [--params 300M] [--buffer-mb 64] [--steps 20] [--repeats 3] [--train]
                         [--tokens 512] [--smoke]

``--device cuda`` (bench/gpu_checks.py's section): the parameters bf16 on the GPU, the fp32 masters and moments on
the disk (12 B a parameter), against ZeRO-Offload's states in host memory (``cpu``).
``--smoke``: toy sizes, to check the script (tests/bench/test_bench_nvme.py). Not a test.
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
from torch import nn  # noqa: E402

from megazero.config.load import load_config  # noqa: E402
from megazero.config.resolve import resolve  # noqa: E402
from megazero.engine.build import build_engine  # noqa: E402
from megazero.engine.step import train_step  # noqa: E402
from megazero.parallel.dims import ParallelDims  # noqa: E402
from megazero.parallel.topology import Grid  # noqa: E402
from megazero.parallel.zero.adamw import ShardedAdamW  # noqa: E402
from megazero.parallel.zero.layout import BucketLayout  # noqa: E402
from megazero.parallel.zero.nvme_adamw import FLOAT, NvmeAdamW, NvmeSettings  # noqa: E402
from megazero.parallel.zero.nvme_file import NvmeFile, aligned_empty  # noqa: E402
from megazero.parallel.zero.policy import StagePolicy  # noqa: E402

HYPER = dict(weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


def _count(text: str) -> int:
    units = {"K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def disk_throughput(folder: Path, mb: int, record: int) -> tuple[float, float, bool]:
    """(write GB/s, read GB/s, O_DIRECT) of ``mb`` MB in records of ``record`` bytes, two in flight."""
    f = NvmeFile(folder, "--path")
    count = max(2, mb * 2 ** 20 // record)
    f.grow(count * record)
    buffers = [aligned_empty(record) for _ in range(2)]
    for b in buffers:
        b.random_(0, 255)
    rates = []
    for call in (f.write, f.read):
        began, pending = time.perf_counter(), [None, None]
        for k in range(count):
            slot = k % 2
            if pending[slot] is not None:
                pending[slot].result()
            pending[slot] = call(buffers[slot], f.nbytes - count * record + k * record)
        for p in pending:
            p.result()
        if call == f.write:  # buffered I/O: the bytes on the disk, and not read back from the page cache
            os.fsync(f.fd)
            os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        rates.append(count * record / (time.perf_counter() - began) / 1e9)
    direct = f.direct
    f.close()
    return rates[0], rates[1], direct


def _module(params: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Square-ish matrices (decaying) and a vector per matrix, ~``params`` elements."""
    m = nn.Module()
    side = 4096 if params >= 50_000_000 else 256
    count = max(1, params // (side * side))
    for j in range(count):
        setattr(m, f"w{j}", nn.Parameter(torch.randn(side, side, dtype=dtype, device=device) * 0.02))
        setattr(m, f"b{j}", nn.Parameter(torch.zeros(side, dtype=dtype, device=device)))
    return m


def build(kind: str, params: int, dtype: torch.dtype, device: torch.device, folder: Path, buffer_mb: float,
          bucket_mb: float):
    torch.manual_seed(0)
    module = _module(params, dtype, device)
    layout = BucketLayout([module], StagePolicy.of(0), 1, 0, dtype, torch.float32, bucket_mb, device)
    state_device = torch.device("cpu")
    if kind == "nvme":
        optim = NvmeAdamW(layout, device, HYPER["weight_decay"], HYPER["betas"], HYPER["eps"], torch.float32,
                          NvmeSettings(folder, int(buffer_mb * 2 ** 20)))
    else:  # in memory: the host's, where the model computes there or its states are offloaded (cpu)
        optim = ShardedAdamW(layout, device, state_device, "fused", HYPER["weight_decay"], HYPER["betas"],
                             HYPER["eps"], torch.float32)

    def add(bucket, master):
        decay, count, _ = layout.mask_runs(bucket, 0)
        optim.add_bucket(bucket, master, decay, count)
    layout.materialise(None, add)
    return layout, optim


TRAIN_SHAPE = (24, 1024, 16, 2816, 256)  # layers, hidden, heads, ffn, seq: 312.5M parameters with a vocabulary of 2,048
SMOKE_SHAPE = (2, 64, 2, 128, 32)


def _engine(kind: str, shape: tuple, tokens: int, folder: Path, buffer_mb: float):
    """One process's engine for the Llama of ``shape``, fp32, ZeRO 0, its AdamW states in memory or on the disk."""
    layers, hidden, heads, ffn, seq = shape
    sets = ["model.arch=llama", f"model.layers={layers}", f"model.hidden={hidden}", f"model.heads={heads}",
            f"model.kv_heads={heads}", f"model.ffn_hidden={ffn}", "model.vocab_size=2048", f"model.seq_len={seq}",
            "model.tie_embeddings=false", "train.micro_batch=1", f"train.global_batch={max(1, tokens // seq)}",
            "train.precision=fp32", "parallel.tp=1", "parallel.pp=1", "parallel.dp=1",
            "parallel.sequence_parallel=false", "zero.stage=0", "kernels.attention=torch", "kernels.adam=fused"]
    if kind == "nvme":
        sets += ["zero.offload_optimizer=nvme", f"zero.nvme_path={folder}", f"zero.nvme_buffer_mb={buffer_mb}"]
    cfg = load_config(os.path.join(ROOT, "configs", "tiny-llama.yaml"), sets)
    resolve(cfg, 1, "cpu")
    torch.manual_seed(0)
    return build_engine(cfg, Grid.build(ParallelDims(tp=1, pp=1, dp=1), "cpu"), torch.device("cpu"))


def _table(what: str, names: dict[str, str], times: dict[str, list[float]], digits: int) -> None:
    """A row per way (``names``: key -> row name, in order): the median of the rounds' medians, each round's, and
    the ratio to the states in memory."""
    print(f"| {what} | median s | rounds' medians | / in memory |")
    print("|---|---|---|---|")
    ref = statistics.median(times["memory"])
    for k, name in names.items():
        med = statistics.median(times[k])
        print(f"| {name} | {med:.{digits}f} | {' '.join(f'{t:.{digits}f}' for t in times[k])} | {med / ref:.2f} |")


def training_steps(args, folder: Path) -> None:
    """Part 3: the whole training step with the states in memory and on the disk, alternating."""
    shape = SMOKE_SHAPE if args.smoke else TRAIN_SHAPE
    engines = {k: _engine(k, shape, args.tokens, folder / "train", args.buffer_mb) for k in ("memory", "nvme")}
    n = sum(p.numel() for c in engines["memory"].zero.parts[0].layout.chunks for p in c.parameters())
    seq = shape[-1]
    g = torch.Generator().manual_seed(0)
    times = {k: [] for k in engines}
    same = True
    for _ in range(args.repeats):
        rounds = {k: [] for k in engines}
        for step in range(args.steps + 2):
            mbs = [torch.randint(0, 2048, (1, seq + 1), generator=g) for _ in range(max(1, args.tokens // seq))]
            losses = []
            for k, e in engines.items():
                began = time.perf_counter()
                result = train_step(e.zero, e.executor, e.schedule, mbs, 1e-4, 1.0, e.scaler)
                losses.append(result.loss_sum.item())  # the step's end: its host read
                if step >= 2:
                    rounds[k].append(time.perf_counter() - began)
            same = same and losses[0] == losses[1]
        for k in engines:
            times[k].append(statistics.median(rounds[k]))
    print(f"\n### The training step: a Llama of {n / 1e6:,.1f}M parameters, {max(1, args.tokens // seq) * seq:,} "
          f"tokens a step (sequences of {seq}), fp32, one process\n")
    _table("training step (forward, backward, optimizer)",
           {"memory": "states in memory", "nvme": "states on the disk (nvme)"}, times, 3)
    print(f"\nThe two runs' losses {'are equal at every step' if same else 'DIFFER'}.")
    for e in engines.values():
        e.zero.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", help="a folder on the disk to measure (default: a temporary folder)")
    ap.add_argument("--params", default="300M")
    ap.add_argument("--buffer-mb", type=float, default=64.0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--train", action="store_true", help="also the whole training step (CPU), part 3")
    ap.add_argument("--tokens", type=int, default=512, help="with --train: tokens a training step")
    ap.add_argument("--smoke", action="store_true", help="toy sizes: checks the script")
    args = ap.parse_args()
    if args.train and args.device != "cpu":
        ap.error("--train: the CPU's training step (a GPU run times the optimizer step)")
    if args.smoke:
        args.params, args.buffer_mb, args.steps, args.repeats = "300K", 0.2, 3, 1
    params = _count(args.params)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base = Path(args.path) if args.path else Path(tempfile.mkdtemp(prefix="megazero-bench-nvme-"))
    folder = base / f"bench-nvme-{os.getpid()}"
    try:
        return _run(args, params, device, dtype, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if not args.path:
            shutil.rmtree(base, ignore_errors=True)


def _run(args, params: int, device: torch.device, dtype: torch.dtype, folder: Path) -> int:
    bucket_mb = 25.0 if not args.smoke else 0.05
    layouts = {k: build(k, params, dtype, device, folder, args.buffer_mb, bucket_mb) for k in ("memory", "nvme")}
    nvme = layouts["nvme"][1]
    record = nvme.kinds * nvme.chunk * FLOAT
    n = sum(hi - lo for b in layouts["nvme"][0].buckets for lo, hi in [layouts["nvme"][0].range(b)])
    write, read, direct = disk_throughput(folder / "raw", max(64, int(n * FLOAT * nvme.kinds / 2 ** 20 / 4)),
                                          record)
    grads = [torch.randn(hi - lo, generator=torch.Generator().manual_seed(7)).to(device)
             for b in layouts["memory"][0].buckets for lo, hi in [layouts["memory"][0].range(b)]]
    names = {"memory": "states in memory (none; cpu on a CPU machine)" if device.type == "cpu"
             else "states in host memory (cpu)", "nvme": "states on the disk (nvme)"}
    times = {k: [] for k in layouts}
    moved = []
    for _ in range(args.repeats):
        rounds = {k: [] for k in layouts}
        for step in range(args.steps + 2):
            for k, (_, optim) in layouts.items():
                if device.type == "cuda":
                    torch.cuda.synchronize()
                before = (getattr(optim, "bytes_read", 0), getattr(optim, "bytes_written", 0))
                began = time.perf_counter()
                optim.update(grads, 1e-4, 1.0, set())  # grad_scale 1: the kernel leaves them as they are
                if device.type == "cuda":
                    torch.cuda.synchronize()
                took = time.perf_counter() - began
                if step >= 2:
                    rounds[k].append(took)
                    if k == "nvme":
                        moved.append((optim.bytes_read - before[0], optim.bytes_written - before[1], took))
        for k in layouts:
            times[k].append(statistics.median(rounds[k]))
    print(f"## NVMe offload: {params / 1e6:,.1f}M parameters, {dtype}, {device.type}, "
          f"{args.buffer_mb:g} MB of host buffers, chunks of {nvme.chunk:,} elements\n")
    print(f"Disk under {folder.parent} ({'O_DIRECT' if direct else 'buffered I/O'}), records of {record:,} bytes, "
          f"two in flight: write {write:.2f} GB/s, read {read:.2f} GB/s\n")
    _table("optimizer step", names, times, 4)
    r, w, t = (statistics.median(x) for x in zip(*moved))
    print(f"\nThe NVMe step moves {r / 1e9:.3f} GB in and {w / 1e9:.3f} GB out: {(r + w) / t / 1e9:.2f} GB/s "
          f"effective, against the disk's {read:.2f} GB/s read and {write:.2f} GB/s write above "
          f"({(r + w) / t / 1e9 / (2 / (1 / read + 1 / write)):.0%} of their harmonic mean).")
    for _, optim in layouts.values():
        optim.close()
    del layouts, grads
    if args.train:
        training_steps(args, folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())

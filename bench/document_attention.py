"""One document-masked attention call, forward and backward: the path kernels.attention=auto takes against SDPA
with the dense (1, 1, s, s) mask; bench/mfu.py prints it as its second table (seq 8192 on a GPU)."""
from __future__ import annotations

import statistics
import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def document_table(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, seq: int,
                   steps: int, repeats: int) -> None:
    """One attention call's forward and backward under a document mask (documents of 512-1,535 tokens, mean
    1,024): the path kernels.attention=auto takes against SDPA with the dense (1, 1, s, s) mask; the median of
    ``repeats`` rounds' median step, tokens/s and the peak memory beyond q, k and v."""
    from megazero.kernels.attend import attention, resolve_impl
    from megazero.plan.tracker import MemoryTracker

    gen = torch.Generator().manual_seed(0)
    lengths: list[int] = []
    while sum(lengths) < seq:
        lengths.append(int(torch.randint(512, 1536, (1,), generator=gen)) if seq >= 4096 else 5 + len(lengths))
    docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:seq][None].to(device)
    q = torch.randn(1, heads, seq, head_dim, generator=gen).to(device, dtype)
    k, v = (torch.randn(1, kv_heads, seq, head_dim, generator=gen).to(device, dtype) for _ in range(2))
    dout = torch.randn_like(q)
    chosen = resolve_impl("auto", device.type, head_dim, documents=True)

    def once(impl: str) -> float:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        _sync(device)
        t0 = time.perf_counter()
        attention(*leaves, True, impl, documents=docs).backward(dout)
        _sync(device)
        return time.perf_counter() - t0

    def peak(impl: str) -> int:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            once(impl)
            return torch.cuda.max_memory_allocated() - base
        tracker = MemoryTracker()
        with tracker:
            tracker.restart_peak("step")
            base = tracker.device_bytes
            once(impl)
            return tracker.report().peak_bytes - base

    print(f"\n## Document-masked attention, one call forward + backward: seq {seq:,}, {heads}/{kv_heads} heads of "
          f"{head_dim}, {len(lengths)} documents (mean {seq // len(lengths):,} tokens), {str(dtype)[6:]}\n")
    print("| path | median s | rounds' medians | / dense | tokens/s | peak memory MiB |")
    print("|---|---|---|---|---|---|")
    paths = {f"auto ({chosen})": chosen, "torch, dense mask": "torch"}
    rounds: dict[str, list[float]] = {name: [] for name in paths}
    for name, impl in paths.items():
        once(impl)  # warm-up
    for _ in range(repeats):
        for name, impl in paths.items():
            rounds[name].append(statistics.median(once(impl) for _ in range(steps)))
    dense = statistics.median(rounds["torch, dense mask"])
    for name, impl in paths.items():
        t = statistics.median(rounds[name])
        print(f"| {name} | {t:.4f} | {' '.join(f'{r:.4f}' for r in rounds[name])} | {t / dense:.3f} | "
              f"{seq / t:,.0f} | {peak(impl) / 2**20:,.1f} |")

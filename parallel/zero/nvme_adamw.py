"""AdamW with its fp32 masters and moments on a local disk (``zero.offload_optimizer=nvme``), streamed.

ZeRO-Infinity (Rajbhandari et al., SC'21, sections 5-6): the states of this rank's range live in one scratch file
(``parallel.zero.nvme_file``), cut into chunks of C elements; chunk k's record holds its master (where the master
is not the fp32 parameter itself) and both moments, C each, so a chunk is one read and one write. The step walks
every bucket's chunks in order through three page-aligned host slots: it reads chunk k+1 and writes chunk k-1
while torch's fused CPU AdamW (``kernels.adam_cpu``) updates chunk k. Host memory for the states is the three
slots (``zero.nvme_buffer_mb``), whatever the model's size. The update is elementwise, so the chunks give the
in-memory run's values bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

from megazero.kernels.adam import adamw
from megazero.kernels.adam_cpu import CPU_CHUNK, Run
from megazero.parallel.zero.adamw import ShardedAdamW, make_adamw
from megazero.parallel.zero.layout import Bucket, BucketLayout
from megazero.parallel.zero.nvme_file import PAGE, NvmeFile, SimulatedFile, aligned_empty

if TYPE_CHECKING:
    from megazero.parallel.zero.registry import AdamWSection
    from megazero.parallel.zero.update import UpdateContext

SLOTS = 3  # the chunk being read, the one being updated, the one being written
FLOAT = 4
STEP = PAGE // FLOAT  # a record's arrays are a whole number of pages of fp32
VECTOR = 16  # elements the fused CPU AdamW takes at once (AVX-512 fp32); a multiple of the narrower widths


@dataclass(frozen=True)
class NvmeSettings:
    """Where this rank's scratch file goes and how much host memory streams it."""

    folder: Path  # zero.nvme_path / rank_<global rank>
    buffer_bytes: int  # zero.nvme_buffer_mb: the three slots together


def chunk_elements(buffer_bytes: int, kinds: int) -> int:
    """The chunk length C: three slots of ``kinds`` fp32 arrays of C fit the buffer, C a whole number of pages."""
    return max(STEP, buffer_bytes // (SLOTS * kinds * FLOAT) // STEP * STEP)


def make_adamw_for(section: "AdamWSection", ctx: "UpdateContext") -> ShardedAdamW:
    """The registry's factory for AdamW: its states where the context puts them, in memory (``make_adamw``) or on
    a local disk (``ctx.nvme``)."""
    if ctx.nvme is None:
        return make_adamw(section, ctx)
    return NvmeAdamW(ctx.layout, ctx.device, ctx.weight_decay, (section.beta1, section.beta2), section.eps,
                     ctx.grad_dtype, ctx.nvme)


def _within(runs: list[Run], lo: int, hi: int) -> list[Run]:
    """The runs of [lo, hi), relative to lo."""
    return [(max(a, lo) - lo, min(z, hi) - lo, on) for a, z, on in runs if a < hi and z > lo]


class NvmeAdamW(ShardedAdamW):
    def __init__(self, layout: BucketLayout, device: torch.device, weight_decay: float, betas: tuple[float, float],
                 eps: float, grad_dtype: torch.dtype, settings: NvmeSettings, key: str = "zero.nvme_path"):
        super().__init__(layout, device, torch.device("cpu"), "fused", weight_decay, betas, eps, grad_dtype)
        # fp32 parameters in host memory are their own masters, as in memory: only the moments go to the disk
        self.masters_on_disk = not (layout.dtype == torch.float32 and device.type == "cpu")
        self.kinds = 3 if self.masters_on_disk else 2
        # the three slots together no larger than the states: a small model's buffers are its states' size at most
        third = -(-sum(hi - lo for b in layout.buckets for lo, hi in [layout.range(b)]) // SLOTS)
        self.chunk = min(chunk_elements(settings.buffer_bytes, self.kinds), max(STEP, -(-third // STEP) * STEP))
        record = self.kinds * self.chunk * FLOAT
        # per bucket: its chunks (first element, last + 1, the record's byte offset, its arrays' stride)
        self.chunks: list[list[tuple[int, int, int, int]]] = [[] for _ in layout.buckets]
        if isinstance(torch.empty(0), FakeTensor):  # --simulate: the shapes of the step, no disk
            self.file = SimulatedFile(settings.folder)
            self.slots = [torch.empty(record, dtype=torch.uint8) for _ in range(SLOTS)]
        else:
            self.file = NvmeFile(settings.folder, key)
            self.slots = [aligned_empty(record) for _ in range(SLOTS)]
        self.bytes_read = self.bytes_written = 0

    # ----- a chunk's record in a slot -------------------------------------------------------------------------------
    def _views(self, slot: int, n: int, stride: int) -> dict[str, Tensor]:
        """The slot's fp32 arrays (``stride`` apart: the chunk's record), cut to the chunk's ``n`` elements."""
        flat = self.slots[slot].view(torch.float32)
        names = ("master", "exp_avg", "exp_avg_sq") if self.masters_on_disk else ("exp_avg", "exp_avg_sq")
        return {k: flat[j * stride:j * stride + n] for j, k in enumerate(names)}

    def _record(self, slot: int, stride: int) -> Tensor:
        """The slot's bytes that hold a record of arrays ``stride`` long."""
        return self.slots[slot][:self.kinds * stride * FLOAT]

    def _plan_chunks(self, i: int, n: int, runs: list[Run], cuts_like_memory: bool) -> None:
        """Bucket i's chunks, and their records appended to the file. A chunk ends where the in-memory update's
        pieces end or 16 elements on from a run's start: the fused kernel takes 16 elements a vector and the rest
        one by one, so any other cut would move elements between the two (a last-bit difference). Where the
        in-memory step converts the gradient or copies to the model, it cuts every CPU_CHUNK elements: so do the
        chunks, and never cross one."""
        chunks, a, offset = [], 0, self.file.nbytes
        while a < n:
            z = min(a + self.chunk, n)
            if cuts_like_memory:
                z = min(z, (a // CPU_CHUNK + 1) * CPU_CHUNK)
            if z < n and not (cuts_like_memory and z % CPU_CHUNK == 0):
                s, e = next(((s, e) for s, e, _ in runs if s < z <= e), (z, z))
                if z < e:  # the kernel counts its vectors from its piece's start: the run's, or its window's
                    s = max(s, a // CPU_CHUNK * CPU_CHUNK) if cuts_like_memory else s
                    z = s + (z - s) // VECTOR * VECTOR if z - s >= VECTOR else s
            stride = -(-(z - a) // STEP) * STEP
            chunks.append((a, z, offset, stride))
            a, offset = z, offset + self.kinds * stride * FLOAT
        try:
            self.file.grow(offset - self.file.nbytes)
        except BaseException:  # the run stops before it starts: nothing of it is left on the disk
            self.close()
            raise
        self.chunks[i] = chunks

    def _write_now(self, slot: int, offset: int, stride: int) -> None:
        self.bytes_written += self.file.write(self._record(slot, stride), offset).result()

    def _read_now(self, slot: int, offset: int, stride: int) -> None:
        self.bytes_read += self.file.read(self._record(slot, stride), offset).result()

    # ----- states -----------------------------------------------------------------------------------------------
    def add_bucket(self, b: Bucket, initial: Tensor, decay: list[Run], count: list[Run]) -> None:
        """Write the bucket's initial master (unless the parameter is its own) and zero moments to its records."""
        i = b.index
        target = self.target(b)
        self.master_is_param[i] = not self.masters_on_disk
        assert self.master_is_param[i] == (target.dtype == torch.float32 and target.device == self.device), \
            "fp32 parameters in host memory are their own masters"
        if self.master_is_param[i]:
            self.master[i] = target
        if self.pinned:  # the reduced gradient's landing buffer on the host, as ShardedAdamW's
            self.host_grad[i] = torch.empty(initial.numel(), dtype=self.grad_dtype, pin_memory=True)
        self.runs[i], self.counted[i] = decay, count
        n = initial.numel()
        cuts_like_memory = self.grad_dtype != torch.float32 or (not self.master_is_param[i]
                                                                and target.device.type == "cpu")
        self._plan_chunks(i, n, decay if self.weight_decay else [(0, n, False)], cuts_like_memory)
        for a, z, offset, stride in self.chunks[i]:
            views = self._views(0, z - a, stride)
            self.slots[0].zero_()
            if self.masters_on_disk:
                views["master"].copy_(initial[a:z])
            self._write_now(0, offset, stride)

    def bucket_states(self, i: int) -> dict[str, Optional[Tensor]]:
        """Bucket i's states read back whole (a save: one bucket at a time)."""
        lo, hi = self.layout.range(self.layout.buckets[i])
        out = {k: torch.empty(hi - lo, dtype=torch.float32) for k in ("exp_avg", "exp_avg_sq")}
        if self.master_is_param[i]:  # the parameter: in memory, or read from its own file (offload_params=nvme)
            out["master"] = self.layout.shard_values(self.layout.buckets[i]) if self.layout.param_disk is not None \
                else self.master[i]
        else:
            out["master"] = torch.empty(hi - lo, dtype=torch.float32)
        for a, z, offset, stride in self.chunks[i]:
            self._read_now(0, offset, stride)
            for k, v in self._views(0, z - a, stride).items():
                out[k][a:z] = v
        return out

    def load_bucket_states(self, i: int, states: dict[str, Tensor]) -> None:
        """Write a checkpoint's states of bucket i to its records (the master too, unless it is the parameter)."""
        for a, z, offset, stride in self.chunks[i]:
            self.slots[0].zero_()
            for k, v in self._views(0, z - a, stride).items():
                v.copy_(states[k][a:z])
            self._write_now(0, offset, stride)

    # ----- the update -------------------------------------------------------------------------------------------
    def update(self, grads: list[Tensor], lr: float, grad_scale: float, resend: set[int]) -> None:
        """One AdamW step of every bucket's range, chunk by chunk: read ahead one, write behind one."""
        self.step_count += 1
        grads = self.state_grads(grads, resend)
        work = [(b.index, *c) for b in self.layout.buckets for c in self.chunks[b.index]]
        reads: dict[int, object] = {}
        writes: list[Optional[object]] = [None] * SLOTS
        try:
            self._stream(work, reads, writes, lr, grad_scale, grads)
        except BaseException:  # no transfer left in flight on a slot that a later read or save reuses
            for pending in [*reads.values(), *writes]:
                if pending is not None:
                    pending.exception()
            raise
        finally:  # offload_params=nvme: the shard still held (the last bucket's, or where an error stopped) goes back
            for b in self.layout.buckets:
                if self.layout.param_disk is not None and b.shard_param.untyped_storage().nbytes():
                    self.layout.param_disk.store(b)
        for pending in writes:
            if pending is not None:
                self.bytes_written += pending.result()

    def _stream(self, work: list, reads: dict, writes: list, lr: float, grad_scale: float,
                grads: list[Tensor]) -> None:
        """The chunks in order: chunk k+1's read posted, chunk k updated, chunk k's write posted."""
        b1, b2 = self.betas
        if work:
            reads[0] = self.file.read(self._record(0, work[0][4]), work[0][3])
        params = self.layout.param_disk  # offload_params=nvme: a bucket's shard is held while its chunks update
        for k, (i, a, z, offset, stride) in enumerate(work):
            slot = k % SLOTS
            if params is not None and (k == 0 or work[k - 1][0] != i):
                if k:
                    params.store(self.layout.buckets[work[k - 1][0]])
                # the shard is the master (read and updated), or the fp32 master's copy (written whole: not read)
                params.load(self.layout.buckets[i], read=self.master_is_param[i])
                later = next((j for j, *_ in work[k:] if j != i), None)
                if later is not None and self.master_is_param[later]:  # the next shard, read while this one updates
                    params.prefetch(self.layout.buckets[later])
            if k + 1 < len(work):  # the next chunk's read, into a slot whose write has finished
                ahead = (k + 1) % SLOTS
                if writes[ahead] is not None:
                    self.bytes_written += writes[ahead].result()
                    writes[ahead] = None
                reads[k + 1] = self.file.read(self._record(ahead, work[k + 1][4]), work[k + 1][3])
            self.bytes_read += reads.pop(k).result()
            views = self._views(slot, z - a, stride)
            b = self.layout.buckets[i]
            master = self.master[i][a:z] if self.master_is_param[i] else views["master"]
            copy = None if self.master_is_param[i] else self.target(b)[a:z]
            adamw("fused", master, grads[i][a:z], views["exp_avg"], views["exp_avg_sq"], lr=lr, beta1=b1,
                  beta2=b2, eps=self.eps, weight_decay=self.weight_decay, step=self.step_count,
                  runs=_within(self.runs[i], a, z), grad_scale=grad_scale, model_copy=copy)
            writes[slot] = self.file.write(self._record(slot, stride), offset)

    # ----- accounting -------------------------------------------------------------------------------------------
    def state_tensors(self) -> list[Tensor]:
        """In host memory: the three slots (the states themselves are on the disk)."""
        return list(self.slots)

    def state_bytes(self) -> int:
        """Host bytes the states take: the slots."""
        return sum(s.numel() for s in self.slots)

    def disk_bytes(self) -> int:
        """Bytes of the states on the disk (the scratch file)."""
        return self.file.nbytes

    def close(self) -> None:
        self.file.close()


def describe(optims: list[NvmeAdamW], shard_bytes: int = 0) -> str:
    """The start-up line: where this rank's states went, how they are read, and what streams them;
    ``shard_bytes``: stage 3's parameter shards in files beside them (zero.offload_params=nvme)."""
    disk = sum(o.disk_bytes() for o in optims)
    host = sum(o.state_bytes() for o in optims)
    ways = sorted({"O_DIRECT" if o.file.direct else "buffered I/O (the filesystem refuses O_DIRECT)" for o in optims})
    line = (f"zero.offload_optimizer=nvme: this rank's optimizer states, {disk / 2 ** 20:,.1f} MB, in "
            f"{optims[0].file.path.parent} by {' and '.join(ways)}, streamed through {host / 2 ** 20:,.2f} MB of "
            f"host buffers")
    if shard_bytes:
        line += (f"; zero.offload_params=nvme: its parameter shards, {shard_bytes / 2 ** 20:,.1f} MB, beside them, "
                 f"each layer's read as the layer before it is gathered")
    others = optims[0].file.others  # the folder's files of other runs, as the first partition found them
    if others:
        size = sum(p.stat().st_size for p in others if p.exists())
        line += (f"; {len(others)} scratch file(s) of other runs there ({size / 2 ** 20:,.1f} MB, never read; "
                 f"remove them when no run uses them), e.g. {others[0].name}")
    return line

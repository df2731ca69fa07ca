"""Stage 3's parameter shards on a local disk (``zero.offload_params=nvme``), read ahead of their gathers.

ZeRO-Infinity (Rajbhandari et al., SC'21, sections 5-6): with the parameters sharded over dp, this rank's shard of
each layer lives in a scratch file (``parallel.zero.nvme_file``) and comes into host memory only to be gathered,
saved, or updated by the step. The gatherer posts a layer's read when it starts gathering the layer before it, so
the disk works one layer ahead of the gathers, in the backward as in the forward. The step reads a layer's shard
(the next one's read posted meanwhile), updates it with its states and writes it back. Host memory for the
parameters is the shards in flight, a few layers' whatever the model's size. ``b.shard_param`` keeps its shape
and dtype with no storage, as ``b.full`` between gathers, except while the step updates it.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Optional

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

from megazero.parallel.zero.layout import Bucket
from megazero.parallel.zero.nvme_file import PAGE, NvmeFile, SimulatedFile, aligned_empty
from megazero.parallel.zero.nvme_adamw import NvmeSettings


class NvmeParams:
    """The parameter shards of one partition's buckets in one scratch file, a whole number of pages each."""

    def __init__(self, settings: NvmeSettings, key: str = "zero.nvme_path"):
        self.simulated = isinstance(torch.empty(0), FakeTensor)  # --simulate: the shapes, no disk
        self.file = SimulatedFile(settings.folder) if self.simulated else NvmeFile(settings.folder, key,
                                                                                     holds="parameter shards")
        self.place: dict[int, tuple[int, int]] = {}  # bucket index -> (byte offset, bytes)
        self.reads: dict[int, tuple[Future, Tensor]] = {}  # posted reads: bucket index -> (transfer, buffer)
        self.bytes_read = self.bytes_written = 0

    def _buffer(self, b: Bucket) -> Tensor:
        nbytes = self.place[b.index][1]
        return torch.empty(nbytes, dtype=torch.uint8) if self.simulated else aligned_empty(nbytes)

    @staticmethod
    def _values(b: Bucket, buffer: Tensor) -> Tensor:
        """The shard's elements at the start of ``buffer`` (uint8, whole pages)."""
        p = b.shard_param
        return buffer[:p.numel() * p.element_size()].view(p.dtype)

    def add(self, b: Bucket) -> None:
        """Give the bucket its place in the file, write its shard there and free the shard's host memory."""
        p = b.shard_param
        nbytes = -(-p.numel() * p.element_size() // PAGE) * PAGE
        self.place[b.index] = (self.file.nbytes, nbytes)
        self.file.grow(nbytes)
        self.put(b, p)
        p.untyped_storage().resize_(0)

    def put(self, b: Bucket, values: Tensor) -> None:
        """Write ``values`` (the bucket's whole shard: a checkpoint's, or the step's) to its place."""
        self._forget(b)  # a read posted before would hand out the values this replaces
        buffer = self._buffer(b)
        self._values(b, buffer).copy_(values)
        self.bytes_written += self.file.write(buffer, self.place[b.index][0]).result()

    def prefetch(self, b: Optional[Bucket]) -> None:
        """Post the read of the bucket's shard (once: ``take`` hands it out)."""
        if b is None or b.index in self.reads or b.index not in self.place:
            return
        buffer = self._buffer(b)
        self.reads[b.index] = (self.file.read(buffer, self.place[b.index][0]), buffer)

    def take(self, b: Bucket) -> Tensor:
        """The bucket's shard in a host buffer of its own: the read ``prefetch`` posted, or one made now."""
        self.prefetch(b)
        transfer, buffer = self.reads.pop(b.index)
        self.bytes_read += transfer.result()
        return self._values(b, buffer)

    def load(self, b: Bucket, read: bool = True) -> None:
        """``b.shard_param`` holds its values (the step updates it in place) until ``store``; without ``read`` it
        holds memory only, for an update that writes every element (the parameters rounded from fp32 masters)."""
        p = b.shard_param
        p.untyped_storage().resize_(p.numel() * p.element_size())
        if read:
            p.copy_(self.take(b))
        else:
            self._forget(b)

    def store(self, b: Bucket) -> None:
        """Write ``b.shard_param`` back and free its host memory."""
        self.put(b, b.shard_param)
        b.shard_param.untyped_storage().resize_(0)

    def _forget(self, b: Bucket) -> None:
        posted = self.reads.pop(b.index, None)
        if posted is not None:
            posted[0].result()  # its buffer must outlive the transfer

    def disk_bytes(self) -> int:
        """Bytes of the shards on the disk (the scratch file)."""
        return self.file.nbytes

    def close(self) -> None:
        """Wait for posted reads, close and remove the file."""
        for transfer, _ in self.reads.values():
            transfer.exception()
        self.reads.clear()
        self.file.close()

"""Collectives: one counted wrapper per grid group.

Every collective megazero issues, and every pipeline send and receive
(:meth:`Comm.exchange`), goes through a :class:`Comm` (a process group with a
name) and is added up by the run's :class:`CommCounter`: kind, group, element
count and bytes. Tests and benchmarks read the counter instead of
assuming what the code does. A :class:`Pending` carries a collective launched in
one autograd node to the later node that waits for it (``parallel.tp_overlap``).
The Megatron f/g autograd functions built on a Comm are in ``parallel.regions``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megazero.parallel.compile_fence import host_only
from megazero.parallel.op_log import OpLog
from megazero.parallel.step_clock import StepClock, TimedWork

SEQ_DIM = 1  # activations are (batch, seq, hidden)


def ring_wire(kind: str, numel: int, size: int) -> float:
    """Elements a rank sends with a ring algorithm (Patarasuk & Yuan 2009): all-reduce 2(k-1)/k·n,
    reduce-scatter (k-1)/k·n of its n-element input, all-gather (k-1)·n of its n-element shard."""
    k = size
    return {"all_reduce": 2 * (k - 1) / k * numel, "reduce_scatter": (k - 1) / k * numel,
            "all_gather": (k - 1) * numel}.get(kind, float(numel))


@dataclass
class CommTotals:
    """What one kind of collective on one group, for one purpose, added up to so far."""

    calls: int = 0
    numel: int = 0  # elements this rank contributed (the inputs of the collectives)
    bytes: int = 0
    wire: float = 0.0  # elements this rank put on the wire (ring algorithms)
    wire_bytes: float = 0.0  # bytes this rank put on the wire (ring algorithms; a receive puts none)


@dataclass
class CommCounter:
    """Every collective of a run, added up per (kind, group, tag, group size): a long run's counter holds a
    handful of entries, not one record per call. ``last`` is the latest collective issued, named in the
    error when a collective times out."""

    totals: dict = field(default_factory=dict)  # (kind, group, tag, size) -> CommTotals
    last: Optional[str] = None
    ops: OpLog = field(default_factory=OpLog)  # the last operations one by one, for a hang's diagnosis
    clock: StepClock = field(default_factory=StepClock)  # the time waited on them, for stragglers

    def add(self, kind: str, group: str, tensor: Tensor, tag: str, size: int = 1, times: int = 1) -> None:
        """One call (``times`` alike: a simulated ring's step standing for others, parallel.context)."""
        key = (kind, group, tag, size)
        t = self.totals.get(key)
        if t is None:
            t = self.totals[key] = CommTotals()
        n = tensor.numel()
        t.calls += times
        t.numel += n * times
        t.bytes += n * tensor.element_size() * times
        t.wire += ring_wire(kind, n, size) * times
        t.wire_bytes += 0 if kind == "recv" else ring_wire(kind, n, size) * tensor.element_size() * times
        self.last = f"{group}.{kind}.{tag}"

    def reset(self) -> None:
        self.totals.clear()

    def _select(self, kind: Optional[str], group: Optional[str], tag: Optional[str]) -> list[CommTotals]:
        return [t for (k, g, tg, _), t in self.totals.items()
                if (kind is None or k == kind) and (group is None or g == group) and (tag is None or tg == tag)]

    def count(self, kind: Optional[str] = None, group: Optional[str] = None, tag: Optional[str] = None) -> int:
        return sum(t.calls for t in self._select(kind, group, tag))

    def volume(self, kind: Optional[str] = None, group: Optional[str] = None, tag: Optional[str] = None) -> int:
        """Elements contributed by this rank over the selected collectives."""
        return sum(t.numel for t in self._select(kind, group, tag))

    def wire(self, kind: Optional[str] = None, group: Optional[str] = None, tag: Optional[str] = None) -> float:
        """Elements this rank put on the wire over the selected collectives (ring algorithms)."""
        return sum(t.wire for t in self._select(kind, group, tag))

    def sent_bytes(self) -> dict[str, float]:
        """Bytes this rank put on the wire, per group (ring algorithms; sends, not receives)."""
        out: dict[str, float] = {}
        for (_, group, _, _), t in self.totals.items():
            out[group] = out.get(group, 0.0) + t.wire_bytes
        return out

    def summary(self) -> dict[str, int]:
        """Calls per "group.kind.tag"."""
        out: dict[str, int] = {}
        for (kind, group, tag, _), t in self.totals.items():
            name = f"{group}.{kind}.{tag}"
            out[name] = out.get(name, 0) + t.calls
        return out


class Comm:
    """A named process group whose collectives are counted. size 1 (or no group): no-ops, nothing counted."""

    def __init__(self, group: Optional[dist.ProcessGroup], name: str, counter: Optional[CommCounter] = None):
        self.group, self.name, self.counter = group, name, counter
        if group is None:
            self.rank, self.size = 0, 1
        else:
            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self._global: dict[int, int] = {}  # group rank -> global rank, for point-to-point ops
        self.members = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
        # --simulate on fake tensors: a ring over this group runs one step of each kind, each counted for the
        # steps alike it stands for (parallel.context); a real group runs every step
        self.sampled_rings = False

    def __repr__(self) -> str:
        return f"Comm({self.name}, rank {self.rank}/{self.size})"

    @host_only  # host bookkeeping: traced, its running totals would be guards that recompile per call
    def _record(self, kind: str, tensor: Tensor, tag: str, times: int = 1, blocking: bool = True,
                peer: Optional[int] = None) -> Optional[tuple]:
        """Count the call and log it; for a blocking call, what ``_done`` takes when it returns (its op-log entry
        and the clock's mark: the call is a wait), else None."""
        if self.counter is None:
            return None
        self.counter.add(kind, self.name, tensor, tag, self.size, times)
        entry = self.counter.ops.post(kind, self.name, self.members, tag, tensor.numel() * tensor.element_size(),
                                      peer, blocking)
        return (entry, self.counter.clock.mark()) if blocking else None

    @host_only
    def _done(self, token: Optional[tuple]) -> None:
        if token is not None:
            entry, mark = token
            entry["state"] = "completed"
            self.counter.clock.waited_since(mark)

    @host_only
    def _timed(self, work: Any) -> Any:
        """An asynchronous call's work, whose wait the clock counts."""
        return work if work is None or self.counter is None else TimedWork(work, self.counter.clock)

    def exchange(self, ops: Sequence[tuple[str, Tensor, int, str]], times: int = 1) -> list:
        """Post a batch of point-to-point transfers at once (``batch_isend_irecv``), each counted (``times``
        over: a simulated ring's step that stands for others alike).

        ``ops``: ("send" | "recv", tensor, peer, tag) in the order to post them, ``peer`` a rank of this
        group. Returns the work handles: waiting on one makes the device stream wait for its transfer (on
        CUDA the host does not block), so a pipeline posts without a host sync per message.
        """
        if not ops:
            return []
        assert self.size > 1, f"{self}: point-to-point needs a group of two or more ranks"
        p2p = []
        for kind, tensor, peer, tag in ops:
            assert kind in ("send", "recv") and 0 <= peer < self.size and peer != self.rank, (kind, peer, self)
            if peer not in self._global:
                self._global[peer] = dist.get_global_rank(self.group, peer)
            self._record(kind, tensor, tag, times, blocking=False, peer=self._global[peer])
            p2p.append(dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, self._global[peer],
                                  self.group))
        return [self._timed(work) for work in dist.batch_isend_irecv(p2p)]

    def all_reduce(self, x: Tensor, op=dist.ReduceOp.SUM, tag: str = "activation", async_op: bool = False):
        """In place. Returns x, or the work handle with async_op (None at size 1)."""
        if self.size > 1:
            token = self._record("all_reduce", x, tag, blocking=not async_op)
            work = dist.all_reduce(x, op=op, group=self.group, async_op=async_op)
            if async_op:
                return self._timed(work)
            self._done(token)
        return None if async_op else x

    def reduce_scatter_into(self, out: Tensor, x: Tensor, tag: str = "grad", async_op: bool = False):
        """out = this rank's 1/size slice (dim 0) of the sum of every rank's x; a work handle with async_op."""
        if self.size == 1:
            out.copy_(x)
            return None
        token = self._record("reduce_scatter", x, tag, blocking=not async_op)
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        work = fn(out, x, group=self.group, async_op=async_op)
        if not async_op:
            self._done(token)
            return work
        return self._timed(work)

    def all_gather_into(self, out: Tensor, x: Tensor, tag: str = "param", async_op: bool = False):
        """out = every rank's x concatenated (dim 0); a work handle with async_op."""
        if self.size == 1:
            out.copy_(x)
            return None
        token = self._record("all_gather", x, tag, blocking=not async_op)
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = fn(out, x, group=self.group, async_op=async_op)
        if not async_op:
            self._done(token)
            return work
        return self._timed(work)

    def all_gather(self, x: Tensor, dim: int, tag: str = "activation") -> Tensor:
        """Concatenate every rank's x along dim (rank order)."""
        if self.size == 1:
            return x
        token = self._record("all_gather", x, tag)
        moved = x.movedim(dim, 0).contiguous()
        out = torch.empty((self.size * moved.shape[0],) + tuple(moved.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_single(out, moved, self.group)
        self._done(token)
        return out.movedim(0, dim).contiguous()

    def reduce_scatter(self, x: Tensor, dim: int, tag: str = "activation") -> Tensor:
        """Sum over ranks, keep this rank's chunk along dim."""
        if self.size == 1:
            return x
        assert x.shape[dim] % self.size == 0, (x.shape, dim, self.size)
        token = self._record("reduce_scatter", x, tag)
        moved = x.movedim(dim, 0).contiguous()
        out = torch.empty((moved.shape[0] // self.size,) + tuple(moved.shape[1:]), dtype=x.dtype, device=x.device)
        _reduce_scatter_single(out, moved, self.group)
        self._done(token)
        return out.movedim(0, dim).contiguous()

    def all_to_all(self, x: Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
                   tag: str = "activation") -> Tensor:
        """Rows of x (dim 0) to every rank: ``in_splits[r]`` rows go to rank r, ``out_splits[r]`` come from it
        (uneven splits: ``all_to_all_single``). Counted as the rows that leave this rank."""
        if self.size == 1:
            return x
        token = self._record("all_to_all", x[:x.shape[0] - in_splits[self.rank]], tag)
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=self.group)
        self._done(token)
        return out

    def split(self, x: Tensor, dim: int) -> Tensor:
        """This rank's chunk along dim (no communication)."""
        if self.size == 1:
            return x
        assert x.shape[dim] % self.size == 0, (x.shape, dim, self.size)
        return x.chunk(self.size, dim=dim)[self.rank].contiguous()


def _all_gather_single(out: Tensor, x: Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x, group=group)


def _reduce_scatter_single(out: Tensor, x: Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, x, group=group)


# --- autograd functions ---------------------------------------------------------------------------


class Pending:
    """Collectives launched in one autograd node and waited in a later one (``parallel.tp_overlap``)."""

    def __init__(self) -> None:
        self.works: list = []

    def put(self, work) -> None:
        if work is not None:
            self.works.append(work)

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works.clear()

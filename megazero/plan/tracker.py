"""One memory tracker for real and simulated runs: the bytes of every tensor the step allocates, by category,
and the peak with the moment it happened.

A ``TorchDispatchMode`` sees the outputs of every op; a storage it has not seen is counted once, under the
category of the code that made it, until it dies (a weakref callback) or is resized (ZeRO-3's gather and
free use ``UntypedStorage.resize_``, which the dispatcher does not see: patched while the tracker is active,
as torch's ``MemTracker`` does). Under ``FakeTensorMode`` the same mode sees the same ops with fake
outputs, so a real run and ``pretrain.py --simulate`` are measured by one code path, and a real CPU run
validates the simulator (tests/plan/test_simulate.py).

Categories: "params", "grads", "optimizer" (the tensors ``ZeroOptimizer.tensors_by_kind`` names; gradient
buffers made during backward by ``GradReducer._alloc``), "activations" (made by a forward and not freed:
what autograd saves for backward), "comm" (pipeline receive buffers and ZeRO's post-step gather staging)
and "temporaries" (the rest: gradients flowing through backward, the optimizer's scratch).

A storage the tracker first meets as an op's output counts from then on: enter it before building what it
should see (``measure`` builds the trainer inside it), or ``name`` what was made before.

Not seen: memory allocated outside torch's dispatcher (gloo's and NCCL's internal buffers, the CUDA context,
the caching allocator's rounding and fragmentation) and Python objects.
"""
from __future__ import annotations

import functools
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

_DEVICE = torch.ops.prim.device.default
CATEGORIES = ("params", "grads", "optimizer", "activations", "comm", "temporaries")
PROGRESS_S = 15.0  # seconds between progress lines of a watched step
TICK_OPS = 4096  # ops between a watched step's looks at the clock (one forward can take minutes: cp 1024's ring)


@dataclass
class _Storage:
    nbytes: int
    category: str
    host: bool  # lives in host memory while the run computes elsewhere (offloaded): not device bytes


@dataclass
class MemoryReport:
    """What a tracker saw: the device peak, its split by category and when it happened; host bytes apart."""

    peak_bytes: int
    bytes: dict[str, int]  # by category, at the peak
    moment: str
    host_peak_bytes: int  # offloaded states and staging: host memory, not in peak_bytes
    state_bytes: dict[str, int] = field(default_factory=dict)  # params/grads/optimizer at the last name_state
    build_peak_bytes: int = 0  # the peak before restart_peak (building the model and optimizer)


class MemoryTracker(TorchDispatchMode):
    """Count storages as the code makes them; ``watch`` names the roles of a trainer's parts."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.refs: dict[int, weakref.ref] = {}  # id(entry) -> weakref with the freeing callback
        self.current = dict.fromkeys(CATEGORIES, 0)  # device bytes by category
        self.device_bytes = self.host_bytes = 0
        self.peak_bytes = self.host_peak_bytes = 0
        self.peak = dict(self.current)
        self.role = "temporaries"  # the category of what is allocated now
        self.moment = "building the model"
        self.peak_moment = self.moment
        self.state_bytes: dict[str, int] = {}
        self.build_peak = 0  # the peak before restart_peak
        self._resize = None
        self.ops = 0
        self.tick: Optional[Callable[[], None]] = None  # called every TICK_OPS ops (``watching``'s progress)

    # ----- counting -----------------------------------------------------------------------------------------
    def _count(self, entry: _Storage, sign: int) -> None:
        if entry.host:
            self.host_bytes += sign * entry.nbytes
            self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)
        else:
            self.current[entry.category] += sign * entry.nbytes
            self.device_bytes += sign * entry.nbytes
            if self.device_bytes > self.peak_bytes:
                self.peak_bytes, self.peak, self.peak_moment = self.device_bytes, dict(self.current), self.moment

    def _freed(self, entry: _Storage, ref: weakref.ref) -> None:
        self.refs.pop(id(entry), None)
        self._count(entry, -1)

    def _see(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st in self.storages:
            return
        if getattr(t, "fake_device", t.device).type == "meta":  # no memory (ZeRO-3's parameters before gathering)
            return
        entry = _Storage(st.nbytes(), self.role, False)
        self.storages[st] = entry
        self.refs[id(entry)] = weakref.ref(st, functools.partial(self._freed, entry))
        self._count(entry, +1)

    def name(self, tensors: list[torch.Tensor], category: str, host: Optional[bool] = None) -> None:
        """Count these tensors' storages under ``category`` (and as host memory when ``host``), seen or not."""
        for t in tensors:
            self._see(t)
            self._relabel(self.storages[t.untyped_storage()], category, host)

    def _relabel(self, entry: _Storage, category: str, host: Optional[bool]) -> None:
        self._count(entry, -1)
        entry.category = category
        if host is not None:
            entry.host = host
        self._count(entry, +1)

    def name_state(self, zero: Any) -> None:
        """Name a ZeroOptimizer's persistent tensors (``tensors_by_kind``) and note the model-state bytes."""
        kinds = zero.tensors_by_kind()
        for kind in ("params", "grads", "optimizer"):
            self.name(kinds[kind], kind, host=False)
        for t in kinds["host"]:  # offloaded: host memory, under the kind named above
            entry = self.storages[t.untyped_storage()]
            self._relabel(entry, entry.category, True)
        host = {id(t.untyped_storage()) for t in kinds["host"]}
        seen: set[int] = set()
        self.state_bytes = dict.fromkeys(("params", "grads", "optimizer", "host"), 0)
        for kind in ("params", "grads", "optimizer"):
            for t in kinds[kind]:
                st = t.untyped_storage()
                if id(st) in seen:
                    continue
                seen.add(id(st))
                self.state_bytes["host" if id(st) in host else kind] += st.nbytes()

    def restart_peak(self, moment: str) -> None:
        """Measure the peak from now on (what is alive now counts); the one so far is kept as ``build_peak``."""
        self.build_peak = self.peak_bytes
        self.moment = moment
        self.peak_bytes, self.peak, self.peak_moment = self.device_bytes, dict(self.current), moment
        self.host_peak_bytes = self.host_bytes

    def _resized(self, st: torch.UntypedStorage) -> None:
        entry = self.storages.get(st)
        if entry is not None and entry.nbytes != st.nbytes():
            self._count(entry, -1)
            entry.nbytes = st.nbytes()
            self._count(entry, +1)

    def __enter__(self) -> "MemoryTracker":
        original = torch.UntypedStorage.resize_
        tracker = self

        @functools.wraps(original)
        def resize_(st: torch.UntypedStorage, size: int):
            out = original(st, size)
            tracker._resized(st)
            return out

        self._resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args) -> None:
        torch.UntypedStorage.resize_ = self._resize
        super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE:  # a fake tensor's .device comes here, the most frequent op by far: answer it at once
            device = getattr(args[0], "fake_device", None)
            return device if device is not None else func(*args)
        if any(t is DTensor for t in types):  # let DTensor unwrap to the local ops, which are seen
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        if self.tick is not None and self.ops % TICK_OPS == 0:
            self.tick()
        if isinstance(out, torch.Tensor):  # the common case, without a pytree walk
            self._see(out)
        elif isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):
            for t in out:
                self._see(t)
        else:
            tree_map_only(torch.Tensor, self._see, out)
        return out

    # ----- roles ------------------------------------------------------------------------------------------
    @contextmanager
    def acting(self, role: Optional[str] = None, moment: Optional[str] = None) -> Iterator[None]:
        """Allocations in this block are ``role``; a peak in it happened at ``moment``."""
        saved = self.role, self.moment
        self.role = role or self.role
        self.moment = moment or self.moment
        try:
            yield
        finally:
            self.role, self.moment = saved

    def report(self) -> MemoryReport:
        return MemoryReport(self.peak_bytes, dict(self.peak), self.peak_moment, self.host_peak_bytes,
                            dict(self.state_bytes), self.build_peak)


@contextmanager
def watching(tracker: MemoryTracker, executor: Any, zero: Any,
             progress: Optional[Callable[[str], None]] = None) -> Iterator[None]:
    """Give a trainer's parts their roles while the block runs, by wrapping these methods on the instances
    (never the classes): the pipeline executor's forward (activations), backward, receives (comm) and run
    (the step count and the schedule phase), and ZeroOptimizer's step, its gradient buffers (grads) and its
    post-step gather (comm). ``progress`` hears how far the steps are, every ``PROGRESS_S`` seconds at most
    (a simulated step of a large stage takes minutes)."""
    state = {"step": 0, "forwards": 0, "backwards": 0, "total": 0, "in_flight": 0}
    started = said = time.perf_counter()

    def tell(within: bool = False) -> None:
        nonlocal said
        now = time.perf_counter()
        if progress is not None and now - said >= PROGRESS_S and state["forwards"]:
            said = now
            done = f"{state['forwards']} forwards and {state['backwards']} backwards of {state['total']}"
            progress(f"at {tracker.moment} ({done} begun), after {now - started:.0f} s" if within else
                     f"step {state['step']}: {done} done, after {now - started:.0f} s")

    def phase() -> str:
        if state["backwards"] == 0:
            return "warm-up" if state["total"] > state["forwards"] or state["forwards"] == 0 else "forwards"
        return "steady state" if state["forwards"] < state["total"] else "cool-down"

    def run(original, actions, microbatches, forward_only=False):
        state.update(step=state["step"] + 1, forwards=0, backwards=0, in_flight=0,
                     total=sum(a.kind == "F" for a in actions))
        return original(actions, microbatches, forward_only)

    def acting(role: str, what: str, original, a, args, kwargs):
        """``original`` run under ``role``, its moment naming the microbatch and the schedule's phase."""
        chunk = f" (model chunk {a.chunk})" if len(executor.chunks) > 1 else ""
        moment = (f"step {state['step']}, {phase()}: {what} of microbatch {a.mb}{chunk}, "
                  f"{state['in_flight']} microbatches in flight")
        try:
            with tracker.acting(role, moment):
                return original(a, *args, **kwargs)
        finally:
            tell()

    def forward(original, a, *args, **kwargs):
        state["forwards"] += 1
        state["in_flight"] += 1
        return acting("activations", "forward", original, a, args, kwargs)

    def backward(original, a, *args, **kwargs):
        state["backwards"] += 1
        try:
            return acting("temporaries", "backward", original, a, args, kwargs)
        finally:
            state["in_flight"] -= 1

    def roled(role: Optional[str], moment: Optional[str] = None):
        def call(original, *args, **kwargs):
            text = moment.format(step=state["step"]) if moment else None
            with tracker.acting(role, text):
                return original(*args, **kwargs)
        return call

    wrapped = [(executor, "run", run), (executor, "_forward", forward), (executor, "_backward", backward),
               (executor, "_post", roled("comm")),
               (zero, "reduce", roled("temporaries", "step {step}: completing the gradient reduction")),
               (zero, "step", roled("temporaries", "step {step}: optimizer step")),
               (zero.reducer, "_alloc", roled("grads")), (zero.gatherer, "after_step", roled("comm"))]
    for obj, name, how in wrapped:
        setattr(obj, name, functools.partial(how, getattr(obj, name)))
    tracker.tick = functools.partial(tell, True) if progress is not None else None
    try:
        yield
    finally:
        tracker.tick = None
        for obj, name, _ in wrapped:
            delattr(obj, name)

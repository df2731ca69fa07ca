"""Pipeline parallelism: which layers each stage holds, and the one executor that runs any schedule.

The schedules themselves are pure functions in ``parallel.schedules``; here
their actions meet tensors: forward and backward of model chunks, and batched
point-to-point transfers through the grid's pp :class:`~parallel.comm.Comm`
(``Comm.exchange``: ``batch_isend_irecv``, each message counted), posted and
waited where ``parallel.schedules.events`` says: in place, or with
``overlap_p2p`` ahead of use and waited at first use. Shapes and
dtypes are known from the config, so no handshake precedes a transfer, and no
transfer synchronises the host with the device. A stage's output activation
is released as soon as it has been sent (Megatron's deallocate-output trick):
backward needs only its autograd graph, not its values.

Schedules with ``W`` actions (zb1p) split each backward: ``B`` computes the
input gradient the previous stage waits for and keeps the graph; ``W``
computes the weight gradients from it later (``parallel.weight_grad``).
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from megazero.parallel.schedules import Action, events, peer, virtual_stage
from megazero.parallel.sequence import SequenceSplit
from megazero.parallel.topology import Grid
from megazero.parallel.weight_grad import DeferredWeightGrad, backward_input


def partition_layers(layers: int, stages: int, explicit: Sequence[int] = ()) -> list[range]:
    """Contiguous layer ranges, one per (virtual) stage: balanced (earlier stages take the remainder)
    unless ``explicit`` lists the count for each."""
    if explicit:
        counts = list(explicit)
        assert len(counts) == stages and sum(counts) == layers, (counts, stages, layers)
    else:
        base, extra = divmod(layers, stages)
        counts = [base + (1 if s < extra else 0) for s in range(stages)]
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def _run_backward(output: Tensor, grad: Tensor) -> None:
    """Backward from an output whose values were released after sending (only its graph is left)."""
    if output.shape == grad.shape:
        torch.autograd.backward(output, grad)
        return
    torch.autograd.Variable._execution_engine.run_backward(
        (output,), (grad,), False, False, (), True, True)


def _release(t: Tensor) -> None:
    t.data = torch.empty((1,), dtype=t.dtype, device=t.device)


class PipelineExecutor:
    """Runs one rank's schedule: its model chunks, microbatches, sends and receives.

    ``loss_fn(chunk_output_loss)``: on the last virtual stage the model returns
    per-token losses; the executor sums them and divides by ``loss_scale_tokens``
    (the global batch's token count) before backward.
    """

    def __init__(self, chunks: list[nn.Module], grid: Grid, act_shape: tuple[int, ...], act_dtype: torch.dtype,
                 device: torch.device, tokens_per_step: int, autocast: Callable, overlap_p2p: bool = False,
                 sequence: Optional[SequenceSplit] = None):
        self.chunks, self.grid = chunks, grid
        # each microbatch's tokens, targets, positions and documents as this rank sees them (its cp chunks)
        self.sequence = sequence if sequence is not None else SequenceSplit(grid.cp_comm)
        self.overlap_p2p = overlap_p2p  # post transfers ahead, wait at first use (schedules.events)
        self.comm = grid.pp_comm  # counted p2p; a peer's pp rank is its rank in the pp group
        assert self.comm.size == grid.pp and (grid.pp == 1 or self.comm.rank == grid.pp_rank), (self.comm, grid)
        self.act_shape, self.act_dtype, self.device = act_shape, act_dtype, device
        self.tokens_per_step = tokens_per_step
        self.autocast = autocast
        self.pp, self.rank = grid.pp, grid.pp_rank
        self.last_vs = self.pp * len(chunks) - 1
        self.trace: list[tuple] = []  # (kind, label, mb, chunk, start stamp, end stamp) of the last run
        self.trace_origin: object = 0.0  # the stamp the last run started at
        self.loss_scale = 1.0  # fp16: the loss is multiplied by the loss scale before backward
        self.peak_held_bytes = 0  # largest total of stage outputs kept between actions (measured)

    def run(self, actions: list[Action], microbatches: list[Tensor], forward_only: bool = False) -> Tensor:
        """Execute the actions; returns this rank's summed token loss (0 off the last stage)."""
        inputs: dict[tuple, Tensor] = {}
        outputs: dict[tuple, Tensor] = {}
        grads: dict[tuple, Tensor] = {}
        deferred: dict[tuple, DeferredWeightGrad] = {}  # split backwards: what each B left for its W
        split = any(a.kind == "W" for a in actions)
        total = torch.zeros((), device=self.device)
        self.trace = []
        self.peak_held_bytes = 0
        self.trace_origin = self._stamp()
        in_flight: dict[int, tuple[list, list[Action], list[Tensor]]] = {}  # posted groups: works, ops, tensors
        op_log = self.comm.counter.ops if self.comm.counter is not None else None  # the action, for a hang's record
        for ev in events(actions, self.overlap_p2p):
            start = self._stamp()
            if ev[0] == "post":
                a, label = ev[2][0], "+".join(str(x) for x in ev[2])
                if op_log is not None:
                    op_log.action = label
                in_flight[ev[1]] = self._post(ev[2], inputs, outputs, grads, forward_only)
            elif ev[0] == "wait":
                works, items, _ = in_flight.pop(ev[1])
                a, label = items[0], "wait " + "+".join(str(x) for x in items)
                if op_log is not None:
                    op_log.action = label
                for work in works:
                    work.wait()
                self._received(items, inputs, outputs, forward_only)
            else:
                a = label = ev[1]
                if op_log is not None:
                    op_log.action = str(a)
                if a.kind == "F":
                    total += self._forward(a, microbatches, inputs, outputs, forward_only)
                elif a.kind == "W":
                    deferred.pop((a.mb, a.chunk)).run()
                else:
                    self._backward(a, inputs, outputs, grads, deferred if split else None)
                label = str(a)
            self.trace.append(("compute" if ev[0] == "compute" else "comm", label, a.mb, a.chunk, start,
                               self._stamp()))
            held = sum(t.numel() * t.element_size() for t in outputs.values())
            self.peak_held_bytes = max(self.peak_held_bytes, held)
        if op_log is not None:
            op_log.action = "after the pipeline"  # the step's reductions and update, or evaluation's end
        assert not in_flight, f"transfers never waited: {list(in_flight)[:4]}"
        assert not outputs or forward_only, f"outputs never consumed: {list(outputs)[:4]}"
        assert not deferred, f"weight gradients never taken: {list(deferred)[:4]}"
        return total

    def _forward(self, a: Action, microbatches, inputs, outputs, forward_only: bool) -> Tensor:
        key = (a.mb, a.chunk)
        vs = virtual_stage(self.rank, a.chunk, self.pp)
        ids, targets, info = self.sequence(microbatches[a.mb], self.device)
        x = ids if vs == 0 else inputs[key]
        model = self.chunks[a.chunk]
        if hasattr(model, "set_loss_weight"):  # auxiliary losses (a router's) are weighted as the main loss
            model.set_loss_weight(0.0 if forward_only else self.loss_scale / self.tokens_per_step)
        with self.autocast():
            if vs == self.last_vs:
                token_loss = model(x, targets, info)
            else:
                out = model(x, info=info)
        if forward_only:
            inputs.pop(key, None)
        if vs != self.last_vs:
            outputs[key] = out
            return torch.zeros((), device=self.device)
        loss_sum = token_loss.float().sum()
        if not forward_only:
            outputs[key] = loss_sum * (self.loss_scale / self.tokens_per_step)
        return loss_sum.detach()

    def _backward(self, a: Action, inputs, outputs, grads, deferred: Optional[dict]) -> None:
        """The whole backward, or (``deferred`` given) only the input gradient, leaving the weights' for W."""
        key = (a.mb, a.chunk)
        vs = virtual_stage(self.rank, a.chunk, self.pp)
        out = outputs.pop(key)
        grad = torch.ones_like(out) if vs == self.last_vs else grads.pop(key)
        if deferred is not None:
            x = [inputs[key]] if vs > 0 else []
            chunk = self.chunks[a.chunk]
            params = [p for p in chunk.parameters() if p.requires_grad]
            # taken in B: a recomputed layer's weight gradients (W would recompute it again), and the
            # vectors (norm scales, biases): O(tokens*h) reductions the node computes in the same call, where
            # deferring them would cost W one more engine run each for work far under a matmul's
            now = chunk.recomputed_parameters() if hasattr(chunk, "recomputed_parameters") else []
            now = list({id(p): p for p in now + [p for p in params if p.dim() < 2]}.values())
            deferred[key] = backward_input([out], [grad], x, params, now)
        elif vs == self.last_vs:
            out.backward()
        else:
            _run_backward(out, grad)
        if vs > 0:
            grads[("send",) + key] = inputs.pop(key).grad
        else:
            inputs.pop(key, None)

    def _post(self, items: list[Action], inputs, outputs, grads, forward_only: bool) -> tuple:
        """Start a group of sends and receives: (works, the actions, the tensors they read or fill)."""
        ops, tensors = [], []
        for a in items:
            key = (a.mb, a.chunk)
            if a.kind == "send_f":
                t = outputs[key].detach()
                if forward_only:
                    outputs.pop(key)
            elif a.kind == "send_b":
                t = grads.pop(("send",) + key)
            else:
                t = torch.empty(self.act_shape, dtype=self.act_dtype, device=self.device)
                if a.kind == "recv_f":
                    inputs[key] = t
                else:
                    grads[key] = t
            tensors.append(t)  # a send reads its tensor until waited
            ops.append(("send" if a.kind.startswith("send") else "recv", t, peer(a, self.rank, self.pp)[0],
                        "activation" if a.kind.endswith("_f") else "grad"))
        return self.comm.exchange(ops), items, tensors

    def _received(self, items: list[Action], inputs, outputs, forward_only: bool) -> None:
        """A group is complete: received inputs join autograd; a sent output keeps only its graph."""
        for a in items:
            key = (a.mb, a.chunk)
            if a.kind == "recv_f" and not forward_only:
                inputs[key].requires_grad_()
            elif a.kind == "send_f" and not forward_only and key in outputs:
                _release(outputs[key])  # backward needs the graph, not the values

    def _stamp(self) -> object:
        """Now: on CUDA an event recorded on the current stream (kernels and NCCL waits are asynchronous, so
        the host clock would time their launches), else the host clock. Recording syncs nothing."""
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def chrome_trace(self, pid: int, trace: Optional[list] = None, origin: object = None) -> list[dict]:
        """A run (default: the last) as Chrome-trace/Perfetto 'complete' events (microseconds).

        On CUDA this waits for the device to reach the run's last event: call it when writing the trace."""
        trace, origin = (self.trace, self.trace_origin) if trace is None else (trace, origin)
        if trace and not isinstance(origin, float):
            trace[-1][-1].synchronize()

        def seconds(stamp) -> float:
            return stamp - origin if isinstance(stamp, float) else origin.elapsed_time(stamp) / 1e3

        events = []
        for kind, label, mb, chunk, start, end in trace:
            t0, t1 = seconds(start), seconds(end)
            events.append({"name": label, "cat": kind, "ph": "X", "pid": pid, "tid": 0,
                           "ts": t0 * 1e6, "dur": (t1 - t0) * 1e6, "args": {"mb": mb, "chunk": chunk}})
        return events


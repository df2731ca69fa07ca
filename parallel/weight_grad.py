"""A backward in two halves: the input gradient now (B), the weight gradients later (W).

Zero-bubble pipeline schedules (Qi et al. 2023, §2) send the input gradient to
the previous stage as soon as it exists and compute the weight gradients when
the rank would otherwise idle. The model needs no changes: the split is made
on autograd's graph.

B runs the engine from the stage's output to its input only, keeping the
graph. Autograd then skips the parameter branches: a linear's node computes
the gradient of its input but not of its weight, which no requested input
needs. Where a parameter branch leaves the input's path (a *join* node: the
matmul whose other operand is the weight), a pre-hook records the gradient
that reached the node. W runs the engine again from each join node, seeded
with that gradient, to the parameters behind it: only the weight halves of
those nodes run, and gradients accumulate into ``.grad`` as a plain backward
would, so post-accumulate hooks (ZeRO's bucket reduction) fire there.

Joins that share a parameter (an embedding tied to the head in one stage) are
run together; a join that the others' recomputation reaches again is fed its
recorded gradient instead of the re-derived one, so nothing is counted twice.
A custom autograd function on a join runs whole in both halves (it cannot
tell which outputs are wanted): correct, but its input gradient is computed
twice.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node

_engine = torch.autograd.Variable._execution_engine


def _node(t: Tensor) -> Optional[Node]:
    """The node gradients for ``t`` flow into: its grad_fn, or a leaf's accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]


class DeferredWeightGrad:
    """What a B leaves for its W: per group of parameters, the join nodes, the gradients recorded at them,
    and the parameters behind them. ``run()`` computes the weight gradients and lets the graph go."""

    def __init__(self, groups: list[dict], full: Optional[tuple] = None):
        self.groups = groups
        self.full = full  # (outputs, grads): no input gradient to split off (the first stage): W runs it all

    def run(self) -> None:
        if self.full is not None:
            outputs, grads = self.full
            _engine.run_backward(outputs, grads, False, False, (), True, True)
        for g in self.groups:
            edges, seeds = [], []
            for node, recorded in zip(g["joins"], g["grads"]):
                for i, grad in enumerate(recorded or ()):
                    if grad is not None:
                        edges.append(GradientEdge(node, i))
                        seeds.append(grad)
            if not edges:
                continue
            handles = []
            if len(g["joins"]) > 1:  # a join reached again through another: its recorded gradient is whole
                handles = [n.register_prehook(lambda _, r=tuple(r): r) for n, r in zip(g["joins"], g["grads"])]
            try:
                _engine.run_backward(tuple(edges), tuple(seeds), True, False, tuple(g["params"]), True, True)
            finally:
                for h in handles:
                    h.remove()
        self.groups, self.full = [], None


def backward_input(outputs: Sequence[Tensor], grads: Sequence[Optional[Tensor]], inputs: Sequence[Tensor],
                   params: Sequence[Tensor], now: Sequence[Tensor] = ()) -> DeferredWeightGrad:
    """B: accumulate d(outputs)/d(inputs) into ``inputs[i].grad``, and the gradients of the parameters ``now``
    (those of recomputed layers: W would recompute them again, once per group); return what W needs for the
    other ``params``."""
    roots = [n for n in map(_node, outputs) if n is not None]
    if not any(n is not None for n in map(_node, inputs)):
        return DeferredWeightGrad([], full=(tuple(outputs), tuple(grads)))
    inputs = list(inputs) + [p for p in now if _node(p) is not None]
    immediate = {id(p) for p in now}
    params = [p for p in params if id(p) not in immediate]
    targets = {n for n in map(_node, inputs) if n is not None}
    # the graph below the outputs, and which of its nodes lead to the inputs (they run in B)
    parents: dict[Node, list[Node]] = {}
    seen, stack = set(roots), list(roots)
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            parents.setdefault(nxt, []).append(node)
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    on_path = set(targets & seen)
    stack = list(on_path)
    while stack:
        for up in parents.get(stack.pop(), ()):
            if up not in on_path:
                on_path.add(up)
                stack.append(up)
    # per parameter: the nodes of the input's path its branch hangs from
    by_param: dict[Node, tuple[Tensor, set]] = {}
    for p in params:
        leaf = _node(p)
        if leaf is None or leaf not in seen:
            continue
        joins, stack, visited = set(), [leaf], {leaf}
        while stack:
            for up in parents.get(stack.pop(), ()):
                if up in on_path:
                    joins.add(up)
                elif up not in visited:
                    visited.add(up)
                    stack.append(up)
        by_param[leaf] = (p, joins)
    # groups: parameters sharing a join are computed together
    groups: list[dict] = []
    group_of: dict[Node, dict] = {}
    for p, joins in by_param.values():
        hit = {id(group_of[j]): group_of[j] for j in joins if j in group_of}
        g = {"joins": set(joins), "params": [p]}
        for other in hit.values():
            g["joins"] |= other["joins"]
            g["params"] += other["params"]
            groups.remove(other)
        groups.append(g)
        for j in g["joins"]:
            group_of[j] = g
    recorded: dict[Node, tuple] = {}
    handles = []
    for g in groups:
        g["joins"] = list(g["joins"])
        for j in g["joins"]:
            handles.append(j.register_prehook(lambda grad_outputs, j=j: recorded.__setitem__(j, grad_outputs)))
    try:
        _engine.run_backward(tuple(outputs), tuple(grads), True, False, tuple(inputs), True, True)
    finally:
        for h in handles:
            h.remove()
    for g in groups:
        g["grads"] = [recorded.get(j) for j in g["joins"]]
    return DeferredWeightGrad(groups)

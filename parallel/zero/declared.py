"""What ZeRO reads of the model: the declarations of each model chunk, never its parameter names.

A chunk given to ``ZeroOptimizer`` may declare

- ``sharding_units() -> [(global name prefix, module)]``, in forward order: the modules whose parameters are
  gathered, freed and reduced as one bucket when parameters are sharded (ZeRO-3); every other parameter of
  the chunk is its root, one bucket gathered for the whole step;
- ``tied_parameters() -> [(name, parameter, counted)]``: parameters another stage holds a copy of, whose
  gradients are summed with it (``parallel.zero.finalize``); ``counted``: whether this copy counts toward
  the gradient norm, so the norm sees each value once.

A chunk without them has no units (it is all root) and nothing tied. What a single parameter declares is
read from its attributes, set by the parallel layers (``parallel.tensor``): ``tp_split_dim``, ``tp_replicas``,
``sequence_parallel``; a parameter reduced over a group of its own (an expert's, over edp x cp) is
declared the same way and read here.
"""
from __future__ import annotations

from torch import nn

DENSE = "dp"  # the group every parameter reduces over unless it declares another
EXPERT = "edp"  # an expert's: the ranks that hold the same experts (parallel.topology)


def reduce_group(p: nn.Parameter) -> str:
    """The group a parameter's gradient is reduced (and, under ZeRO, sharded) over: its ``reduce_group``."""
    group = getattr(p, "reduce_group", DENSE)
    assert group in (DENSE, EXPERT), group
    return group


def sharding_units(chunk: nn.Module) -> list[tuple[str, nn.Module]]:
    """The chunk's sharding units with their global name prefixes, in forward order."""
    declared = getattr(chunk, "sharding_units", None)
    return list(declared()) if declared is not None else []


def tied_parameters(chunks: list[nn.Module]) -> dict[int, bool]:
    """id(parameter) -> whether this copy counts toward the norm, for every tied parameter of ``chunks``."""
    out: dict[int, bool] = {}
    for chunk in chunks:
        declared = getattr(chunk, "tied_parameters", None)
        for _, p, counted in (declared() if declared is not None else []):
            out[id(p)] = bool(counted)
    return out

"""The grid's sizes by name: one ``ParallelDims`` built from ``parallel.*`` and passed to whatever lays ranks
out (``Grid``, the planner, the simulation, the run lock), so that a new dimension is one field here.

Rank order is Megatron's default, tp fastest — ``rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp +
tp_rank`` — and expert parallelism splits dp, fastest within it: ``dp_rank = edp_rank * ep + ep_rank``
(``parallel.topology`` has why).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple


class Coords(NamedTuple):
    """A rank's place along each dimension of the rank order, slowest first."""

    pp: int
    dp: int
    cp: int
    tp: int


@dataclass(frozen=True)
class ParallelDims:
    tp: int = 1  # tensor-parallel ranks
    cp: int = 1  # context-parallel ranks: each sample's sequence split over them
    ep: int = 1  # expert-parallel ranks, carved out of dp
    pp: int = 1  # pipeline stages
    dp: int = 1  # data-parallel ranks (ep of them split the experts)

    ORDER: ClassVar[tuple[str, ...]] = Coords._fields  # slowest to fastest

    def __post_init__(self) -> None:
        assert min(self.tp, self.cp, self.ep, self.pp, self.dp) >= 1, self
        assert self.dp % self.ep == 0, f"parallel.ep={self.ep} must divide dp={self.dp}"

    @classmethod
    def of(cls, parallel: Any) -> "ParallelDims":
        """The sizes of a resolved ``parallel`` config section (dp an integer: after resolve)."""
        assert isinstance(parallel.dp, int), "megazero.config.resolve.resolve() first"
        return cls(tp=parallel.tp, cp=parallel.cp, ep=parallel.ep, pp=parallel.pp, dp=parallel.dp)

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def edp(self) -> int:
        """The ranks that hold copies of the same experts."""
        return self.dp // self.ep

    def coords(self, rank: int) -> Coords:
        assert 0 <= rank < self.world, (rank, self)
        return Coords(rank // (self.dp * self.cp * self.tp), (rank // (self.cp * self.tp)) % self.dp,
                      (rank // self.tp) % self.cp, rank % self.tp)

    def rank(self, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """The global rank at these coordinates."""
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def groups(self, dim: str) -> list[list[int]]:
        """Every group along ``dim`` as lists of global ranks (what the device mesh builds)."""
        assert dim in self.ORDER, dim
        groups: dict[tuple, list[int]] = {}
        for r in range(self.world):
            c = self.coords(r)._asdict()
            groups.setdefault(tuple(v for k, v in c.items() if k != dim), []).append(r)
        return [sorted(g) for _, g in sorted(groups.items())]

    def embedding_groups(self) -> list[list[int]]:
        """For each (dp, cp, tp) position, the first- and last-stage ranks that both hold the tied embedding."""
        return [[self.rank(0, d, c, t), self.rank(self.pp - 1, d, c, t)]
                for d in range(self.dp) for c in range(self.cp) for t in range(self.tp)]

    def __str__(self) -> str:
        return " x ".join(f"{k}={getattr(self, k)}" for k in ("pp", "dp", "cp", "tp")) + \
            (f" (ep={self.ep} inside dp)" if self.ep > 1 else "")

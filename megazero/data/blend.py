"""The training order as index files: the blend of sources, and each source's shuffled epochs.

A blend draws global sample ``g`` from source ``k`` so that every prefix of
the stream holds each source close to its weight, deterministically
(Megatron-LM's BlendedDataset). Here the order is periodic: a period of
``BLOCK`` positions gives source ``k`` ``c_k`` of them (the largest-remainder
rounding of ``w_k * BLOCK``) and places its ``i``-th at time ``(i + 0.5) / c_k``,
merged in time order (ties by source). Within a period each source is within
one sample of its share of every prefix; over periods the shares drift by
under one sample per period, so every prefix of n samples is within about
``1/n + 1/BLOCK`` of the weights. Position ``g`` needs no search: period
``g // BLOCK`` and the block's entry ``g % BLOCK``.

A source's ``j``-th sample in the blend is position ``j % n`` of its epoch
``j // n``'s permutation of its ``n`` samples (a small source cycles through
more epochs than a large one, as in Megatron-LM). Source 0's permutations
are those of a single-source run, so one source reads as it always has.

Megatron-LM also keeps ``doc_idx`` and ``sample_idx`` because it shuffles
documents before cutting samples; megazero cuts samples at fixed strides of a
source's token stream, so a sample's tokens are arithmetic and only the
blend and the permutations need files. Those are built by one rank per node
(the data builder), written atomically under ``data.cache_dir/indices/`` and
memory-mapped by every rank, so a rank neither spends the time nor holds the
memory to build them (an epoch of 1e8 samples is 0.4 GB and seconds to
shuffle). A rank that finds a file missing builds that array in memory (the
same numbers) and keeps at most two epochs per source.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

BLOCK = 1 << 20  # positions per blend period
INDEX_SUBDIR = "indices"
PREBUILD_MIN = 1 << 16  # samples: a smaller source's permutation is built where it is read, in microseconds


def block_counts(weights: Sequence[float], length: int = BLOCK) -> np.ndarray:
    """Positions per source in one period: ``w_k * length`` rounded by largest remainder (sums to length)."""
    w = np.asarray(weights, dtype=np.float64)
    assert len(w) and np.all(w > 0) and np.all(np.isfinite(w)), weights
    exact = w / w.sum() * length
    counts = np.floor(exact).astype(np.int64)
    short = length - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts


def blend_block(counts: np.ndarray) -> np.ndarray:
    """One period: entry ``r`` is ``ordinal * K + source`` (uint64), the source of position ``r`` and how
    many of its positions come before it in the period."""
    k = len(counts)
    times = np.concatenate([(np.arange(c, dtype=np.float64) + 0.5) / c for c in counts])
    source = np.repeat(np.arange(k, dtype=np.uint64), counts)
    ordinal = np.concatenate([np.arange(c, dtype=np.uint64) for c in counts])
    order = np.argsort(times, kind="stable")  # ties: the earlier source first
    return ordinal[order] * np.uint64(k) + source[order]


def epoch_permutation(n: int, seed: int, source: int, epoch: int) -> np.ndarray:
    """Source ``source``'s order of its ``n`` samples in epoch ``epoch`` (source 0: a single source's order)."""
    perm = np.arange(n, dtype=np.uint32 if n < 2 ** 32 else np.int64)
    np.random.default_rng((seed, epoch) if source == 0 else (seed, epoch, source)).shuffle(perm)
    return perm


class IndexFiles:
    """Named arrays under ``cache_dir/indices``: loaded memory-mapped when present and whole, else built
    (and written, atomically, where ``write``). A file that does not load as what its name says is built
    again, never believed."""

    def __init__(self, cache_dir: Path | None, write: bool):
        self.dir = None if cache_dir is None else Path(cache_dir) / INDEX_SUBDIR
        self.write = write and self.dir is not None

    def path(self, name: str) -> Path | None:
        return None if self.dir is None else self.dir / f"{name}.npy"

    def get(self, name: str, dtype: np.dtype, length: int, build: Callable[[], np.ndarray]) -> np.ndarray:
        path = self.path(name)
        if path is not None and path.exists():
            try:
                arr = np.load(path, mmap_mode="r", allow_pickle=False)
                if arr.dtype == dtype and arr.shape == (length,):
                    return arr
            except (OSError, ValueError):
                pass
        arr = build()
        assert arr.dtype == dtype and arr.shape == (length,), (name, arr.dtype, arr.shape)
        if self.write:
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
            try:
                with tmp.open("wb") as f:
                    np.save(f, arr, allow_pickle=False)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
        return arr


def _tag(*parts: object) -> str:
    """Names a file by what decides its numbers (the numpy version too: it owns the generator)."""
    return hashlib.sha256(repr((np.__version__, *parts)).encode()).hexdigest()[:16]


class SampleOrder:
    """Global train position -> (source, that source's sample), for any number of positions."""

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], seed: int, files: IndexFiles):
        assert all(n > 0 for n in sizes), sizes
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.seed = seed
        self.files = files
        self.counts = block_counts(weights) if len(sizes) > 1 else np.array([BLOCK], dtype=np.int64)
        self.block = None
        if len(sizes) > 1:
            self.block = files.get(f"blend-{_tag('blend', self.counts.tolist())}", np.dtype(np.uint64), BLOCK,
                                   lambda: blend_block(self.counts))
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def permutation(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        perm = self._perms.get(key)
        if perm is None:
            n = int(self.sizes[source])
            dtype = np.dtype(np.uint32 if n < 2 ** 32 else np.int64)
            name = f"shuffle-{_tag('shuffle', n, self.seed, source, epoch)}"
            build = lambda: epoch_permutation(n, self.seed, source, epoch)  # noqa: E731
            perm = build() if n < PREBUILD_MIN else self.files.get(name, dtype, n, build)
            mine = [k for k in self._perms if k[0] == source]
            if len(mine) >= 2:  # a batch touches at most two neighbouring epochs of a source
                self._perms.pop(min(mine))
            self._perms[key] = perm
        return perm

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, source sample id) of each global train position."""
        g = np.asarray(positions, dtype=np.int64)
        if self.block is None:
            source = np.zeros(len(g), dtype=np.int64)
            j = g
        else:
            period, r = np.divmod(g, BLOCK)
            code = np.asarray(self.block[r], dtype=np.int64)
            k = len(self.sizes)
            source, ordinal = code % k, code // k
            j = period * self.counts[source] + ordinal
        epoch, pos = np.divmod(j, self.sizes[source])
        sample = np.empty(len(g), dtype=np.int64)
        for s, e in sorted(set(zip(source.tolist(), epoch.tolist()))):
            mask = (source == s) & (epoch == e)
            sample[mask] = self.permutation(s, e)[pos[mask]]
        bad = sample >= self.sizes[source]
        if bad.any():  # a damaged index file that still had the right shape
            raise ValueError(f"sample index out of range for source {int(source[bad][0])}")
        return source, sample

    def prebuild(self, positions: int) -> None:
        """Write the permutations the first ``positions`` global samples read (the builder, before a run).
        Sources under PREBUILD_MIN samples are left to each rank: their permutations take microseconds."""
        if positions <= 0:
            return
        if self.block is None:
            draws = np.array([positions], dtype=np.int64)
        else:
            periods, rest = divmod(positions, BLOCK)
            k = len(self.sizes)
            tail = np.bincount(np.asarray(self.block[:rest], dtype=np.int64) % k, minlength=k)
            draws = periods * self.counts + tail
        for s, (d, n) in enumerate(zip(draws.tolist(), self.sizes.tolist())):
            if n >= PREBUILD_MIN:
                for e in range(-(-d // n)):
                    self.permutation(s, e)

"""The training order as index files: the blend of sources, and each source's shuffled epochs.

A blend draws global sample ``g`` from source ``k`` so that every prefix of
the stream holds each source close to its weight, deterministically, by
Megatron-LM's BlendedDataset rule: each position goes to the source furthest
behind its share (``w_k * (r + 1) - drawn_k`` largest; ties to the earlier
source), which keeps every source within one sample of its share of every
prefix. The order is periodic: a period of ``BLOCK`` positions gives source
``k`` exactly ``c_k`` of them (``w_k * BLOCK`` by largest remainder), so a
position needs no search (period ``g // BLOCK``, entry ``g % BLOCK``) and the
shares drift by under one sample per period (under 1/BLOCK).

A source's ``j``-th sample in the blend is position ``j % n`` of its epoch
``j // n``'s permutation of its ``n`` samples (a small source cycles through
more epochs than a large one, as in Megatron-LM). Source 0's permutations
are those of a single-source run, so one source reads as it always has.

Megatron-LM also keeps ``doc_idx`` and ``sample_idx`` because it shuffles
documents before cutting samples; megazero cuts samples at fixed strides of a
source's token stream, so a sample's tokens are arithmetic and only the
blend and the permutations need files. Those are built by one rank per node
(the data builder), written atomically (fsynced, then renamed) under
``data.cache_dir/indices/`` with a checksum beside each, and memory-mapped by
every rank, so a rank neither spends the time nor holds the memory to build
them (an epoch of 1e8 samples is 0.4 GB and seconds to shuffle). The builder
checks each file against its checksum before the run (the cache is
untrusted: a damaged file is built again); the other ranks open what the
builder checked, and every id read is range-checked. Both files are opened only as regular files, links
not followed (``regular_files``): a FIFO or a link in their place is built again, never waited on. A rank
that finds a file missing builds that array in memory (the same numbers) and keeps at most two epochs per
source.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np
from numpy.lib import format as npy_format

from megazero.data.regular_files import open_regular, own_folder, read_regular, replace_into

BLOCK = 1 << 16  # positions per blend period
INDEX_SUBDIR = "indices"
PREBUILD_MIN = 1 << 20  # samples: a smaller source's permutation (< 4 MB) is built where it is read
PREBUILD_EPOCHS = 64  # per source: later epochs of a source read that often are built where they are read
_DIGEST_BYTES = 64  # a sha256 in hex


def block_counts(weights: Sequence[float], length: int = BLOCK) -> np.ndarray:
    """Positions per source in one period: ``w_k * length`` rounded by largest remainder (sums to length)."""
    w = np.asarray(weights, dtype=np.float64)
    assert len(w) and np.all(w > 0) and np.all(np.isfinite(w)), weights
    w = w / w.max()  # finite weights whose sum would overflow
    exact = w / w.sum() * length
    counts = np.floor(exact).astype(np.int64)
    short = length - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts


def blend_block(counts: np.ndarray) -> np.ndarray:
    """One period: entry ``r`` is ``ordinal * K + source`` (int64): the source of position ``r`` and how
    many of its positions come before it in the period."""
    length, k = int(counts.sum()), len(counts)
    counts = np.asarray(counts, dtype=np.int64)
    drawn = np.zeros(k, dtype=np.int64)
    out = np.empty(length, dtype=np.int64)
    for r in range(length):
        # how far behind its share each source is, times the period: integers, so ties are exact
        s = int(np.argmax(counts * (r + 1) - drawn * length))  # the first of the furthest behind
        out[r] = int(drawn[s]) * k + s
        drawn[s] += 1
    return out


def _block_ok(block: np.ndarray, counts: np.ndarray) -> bool:
    """Whether a loaded period is one: each source ``c_k`` times, its ordinals 0, 1, ... in order."""
    k = len(counts)
    if block.min() < 0 or block.max() >= int(counts.max()) * k:
        return False
    source = block % k
    if not np.array_equal(np.bincount(source, minlength=k), counts):
        return False
    ordinal = (block // k)[np.argsort(source, kind="stable")]
    return np.array_equal(ordinal, np.concatenate([np.arange(c) for c in counts]))


def epoch_permutation(n: int, seed: int, source: int, epoch: int) -> np.ndarray:
    """Source ``source``'s order of its ``n`` samples in epoch ``epoch`` (source 0: a single source's order)."""
    perm = np.arange(n, dtype=np.uint32 if n < 2 ** 32 else np.int64)
    np.random.default_rng((seed, epoch) if source == 0 else (seed, epoch, source)).shuffle(perm)
    return perm


class IndexFiles:
    """Named arrays under ``cache_dir/indices``, each with a sha256 beside it: loaded memory-mapped when
    present and whole, else built (and, where ``write``, written and then mapped, so the writer holds no
    copy either). The writer (the builder) checks a file's bytes against its checksum before using it; a
    file that fails, or does not load as what its name says, or fails ``check``, is built again."""

    def __init__(self, cache_dir: Path | None, write: bool):
        self.dir = None if cache_dir is None else Path(cache_dir) / INDEX_SUBDIR
        self.write = write and self.dir is not None

    def get(self, name: str, dtype: np.dtype, length: int, build: Callable[[], np.ndarray],
            check: Callable[[np.ndarray], bool] | None = None) -> np.ndarray:
        if self.dir is None:
            return build()
        path, digest = self.dir / f"{name}.npy", self.dir / f"{name}.sha256"
        arr = self._load(path, digest, dtype, length, check)
        if arr is not None:
            return arr
        arr = build()
        assert arr.dtype == dtype and arr.shape == (length,), (name, arr.dtype, arr.shape)
        if not self.write:
            return arr
        own_folder(self.dir)
        _write_atomic(path, lambda f: np.save(f, arr, allow_pickle=False))
        with open_regular(path, links=False) as f:
            sha = _sha256(f)
            _write_atomic(digest, lambda out: out.write(sha.encode()))
            return _map_npy(f)

    def _load(self, path: Path, digest: Path, dtype: np.dtype, length: int,
              check: Callable[[np.ndarray], bool] | None) -> np.ndarray | None:
        """The array when both files are regular files (links not followed) and, for the writer, the
        checksum matches; None (build it again) for anything else: missing, damaged, a FIFO, a link."""
        try:
            want = read_regular(digest, _DIGEST_BYTES, links=False)
            with open_regular(path, links=False) as f:
                if self.write and want != _sha256(f).encode():
                    return None
                arr = _map_npy(f)
        except (OSError, ValueError):
            return None
        if arr.dtype != dtype or arr.shape != (length,) or (check is not None and not check(arr)):
            return None
        return arr


def _sha256(f: BinaryIO) -> str:
    f.seek(0)
    return hashlib.file_digest(f, "sha256").hexdigest()


def _map_npy(f: BinaryIO) -> np.ndarray:
    """The array of the open ``.npy`` file ``f``, memory-mapped from this very descriptor (``np.load`` maps
    only by name); ValueError when ``f`` is not a plain ``.npy`` array."""
    f.seek(0)
    version = npy_format.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = npy_format.read_array_header_1_0(f)
    elif version == (2, 0):
        shape, fortran, dtype = npy_format.read_array_header_2_0(f)
    else:
        raise ValueError(f"npy format version {version}")
    if dtype.hasobject or not shape or 0 in shape:
        raise ValueError("not an array of numbers")
    return np.memmap(f, dtype=dtype, mode="r", shape=shape, order="F" if fortran else "C", offset=f.tell())


def _write_atomic(path: Path, write: Callable) -> None:
    """Written under a temporary name, synced, renamed: a crash leaves the old file or the new, whole."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        with tmp.open("wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        replace_into(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _tag(*parts: object) -> str:
    """Names a file by what decides its numbers (the numpy version too: it owns the generator)."""
    return hashlib.sha256(repr((np.__version__, *parts)).encode()).hexdigest()[:16]


class DamagedIndex(Exception):
    """An index file read back ids no source has: the cache was damaged after its checksum was checked."""


class SampleOrder:
    """Global train position -> (source, that source's sample), for any number of positions."""

    def __init__(self, sizes: Sequence[int], counts: np.ndarray, seed: int, files: IndexFiles):
        """sizes: each source's samples; counts: its positions per period (``block_counts``, all > 0)."""
        assert all(n > 0 for n in sizes) and len(counts) == len(sizes) and counts.min() > 0, (sizes, counts)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.seed = seed
        self.files = files
        self.counts = np.asarray(counts, dtype=np.int64)
        self.block = None
        if len(sizes) > 1:
            self.block = files.get(f"blend-{_tag('blend', self.counts.tolist())}", np.dtype(np.int64), BLOCK,
                                   lambda: blend_block(self.counts), lambda b: _block_ok(b, self.counts))
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def _permutation_array(self, source: int, epoch: int) -> np.ndarray:
        n = int(self.sizes[source])
        build = lambda: epoch_permutation(n, self.seed, source, epoch)  # noqa: E731
        if n < PREBUILD_MIN:
            return build()
        dtype = np.dtype(np.uint32 if n < 2 ** 32 else np.int64)
        return self.files.get(f"shuffle-{_tag('shuffle', n, self.seed, source, epoch)}", dtype, n, build)

    def permutation(self, source: int, epoch: int) -> np.ndarray:
        """Source ``source``'s epoch ``epoch``; at most two epochs per source are kept."""
        key = (source, epoch)
        perm = self._perms.get(key)
        if perm is None:
            perm = self._permutation_array(source, epoch)
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
        if ((sample < 0) | (sample >= self.sizes[source])).any():
            raise DamagedIndex(str(self.files.dir))
        return source, sample

    def prebuild(self, positions: int) -> None:
        """Write (or check) the permutations the first ``positions`` global samples read: the builder, before
        a run. Sources under PREBUILD_MIN samples, and epochs past PREBUILD_EPOCHS, are left to each rank."""
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
                for e in range(min(-(-d // n), PREBUILD_EPOCHS)):
                    self._permutation_array(s, e)  # not kept: the run maps it when it reads it

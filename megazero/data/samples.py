"""GPT training samples cut from each source's token stream, and which of them each rank reads.

Each source (one entry of ``data.paths``) splits by whole documents, as
Megatron-LM splits each dataset: its documents up to the boundary nearest
to the train weight of its tokens are for training, the rest for
validation (at least one document each when it has two), so every source is
validated and no document is in both. A source's train stream is its train
documents, EOS-separated, end to end; its validation stream likewise.
Sample ``i`` of a stream is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``:
inputs are its first ``seq_len`` tokens, targets its last ``seq_len``;
consecutive samples share one token so no target is lost, and samples run
across document boundaries (the EOS marks them) as in GPT-2/Megatron-LM
pretraining, never across sources. Sample ids count every source's train
samples first (source by source), then every source's validation samples.

Global train sample ``g`` is drawn from the blend of the sources (their
weights, or their sizes when the config gives none) and the drawn source's
shuffled epochs; see ``blend``. Step ``s`` reads global samples
``[s*gb, (s+1)*gb)``. That defines the global batch without reference to
the layout; a data-parallel rank only takes its contiguous share of it, so
any (tp, pp, dp) sees the same batches in the same order, and resuming at
``consumed_samples`` continues exactly where an uninterrupted run would be.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megazero.data.blend import BLOCK, DamagedIndex, IndexFiles, SampleOrder, block_counts
from megazero.data.documents import name_paths
from megazero.errors import UserError, invalid


class TokenStream:
    """Several 1-D token arrays (memory maps) read as one, without copying them."""

    def __init__(self, arrays: Sequence[np.ndarray]):
        self._arrays = [a for a in arrays if len(a)]
        self._starts = np.cumsum([0] + [len(a) for a in self._arrays]).astype(np.int64)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` as int64."""
        assert 0 <= start and start + length <= len(self), (start, length, len(self))
        out = np.empty(length, dtype=np.int64)
        filled = 0
        part = int(np.searchsorted(self._starts, start, side="right")) - 1
        while filled < length:
            array, base = self._arrays[part], int(self._starts[part])
            lo = start + filled - base
            take = min(length - filled, len(array) - lo)
            out[filled : filled + take] = array[lo : lo + take]
            filled += take
            part += 1
        return out


_SPLIT_VALID = ("expected 'train,validation' weights, finite and >= 0 with train > 0, e.g. '98,2' "
               "('100,0': no validation set)")


def parse_split(split: str, source: str | None = None) -> tuple[float, float]:
    """``"98,2"`` -> (0.98, 0.02): train and validation weights, normalised. A validation weight of 0 means
    no validation set (the config rules then require train.eval_every = 0). ``source`` names the config
    file in the error."""
    try:
        weights = [float(w) for w in str(split).split(",")]
    except ValueError:
        weights = []
    total = sum(weights)
    if len(weights) != 2 or not np.isfinite(total) or min(weights) < 0 or weights[0] <= 0:
        raise invalid(source, "data.split", split, _SPLIT_VALID)
    return weights[0] / total, weights[1] / total


def rank_share(global_batch: int, dp_rank: int, dp: int, micro_batch: int) -> tuple[int, int]:
    """Offsets ``[lo, hi)`` of rank ``dp_rank``'s share inside a global batch."""
    if dp < 1 or not 0 <= dp_rank < dp:
        raise UserError(f"dp_rank {dp_rank} is not valid for dp {dp}")
    if micro_batch < 1 or global_batch < 1:
        raise UserError(f"train.global_batch {global_batch} and train.micro_batch {micro_batch} must be positive")
    if global_batch % (dp * micro_batch):
        raise UserError(
            f"train.global_batch {global_batch} is not a multiple of train.micro_batch {micro_batch} x dp {dp} "
            f"= {dp * micro_batch}"
        )
    per_rank = global_batch // dp
    return dp_rank * per_rank, (dp_rank + 1) * per_rank


def validation_start(doc_offsets: np.ndarray, w_train: float) -> int:
    """Where a source's validation documents start (a token offset): the document boundary nearest to
    ``w_train`` of its tokens (the later one on a tie), with at least one document on each side when it has
    two or more. Nearest, not the next: one long document across the mark would otherwise take most of the
    validation share (a library file in the built-in corpus left 0.1% of 2%)."""
    n_tokens, n_docs = int(doc_offsets[-1]), len(doc_offsets) - 1
    if w_train >= 1.0 or n_docs < 2:
        return n_tokens
    inner = doc_offsets[1:n_docs].astype(np.int64)  # the boundaries that leave a document on each side
    target = round(n_tokens * w_train)
    k = int(np.searchsorted(inner, target))  # inner[k] is the first boundary at or past the mark
    below, above = int(inner[max(k - 1, 0)]), int(inner[min(k, len(inner) - 1)])
    return above if abs(above - target) <= abs(target - below) else below


def _too_small(samples: GPTSamples, which: Sequence[int], sources: Sequence[tuple[np.ndarray, np.ndarray]],
               split: str, w_val: float) -> str:
    """Why the sources ``which`` have no training sample (one source), or together no validation sample:
    too few tokens, or one document each, which cannot be split."""
    which = list(which)
    where = name_paths([samples.labels[k] for k in which])
    seq_len = samples.seq_len
    n_train = sum(int(samples.train_sizes[k]) for k in which)
    n_val = sum(int(samples.val_sizes[k]) for k in which)
    if n_train and w_val > 0 and not n_val and all(len(sources[k][1]) < 3 for k in which):
        return (
            f"{where} holds one document{' per source' if len(which) > 1 else ''}, and data.split {split!r} "
            "takes each source's validation from its last whole documents, so there is no validation data; "
            "give several documents (several .txt files, or one per .jsonl line)"
        )
    train_tokens = sum(len(samples.train_streams[k]) for k in which)
    val_tokens = sum(len(samples.val_streams[k]) for k in which)
    return (
        f"{where} is too small for model.seq_len {seq_len} and data.split {split!r}: {train_tokens} training "
        f"and {val_tokens} validation tokens (split by document) make {n_train} and {n_val} samples of "
        f"{seq_len + 1} tokens; add data or lower model.seq_len"
    )


class GPTSamples:
    """The sample index math over the sources' train and validation streams; holds no tokens itself."""

    def __init__(self, sources: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int, seed: int, split: str,
                 names: Sequence[str] = (), weights: Sequence[float] | None = None,
                 files: IndexFiles | None = None, labels: Sequence[str] = ()):
        """sources: (tokens, document offsets) of each dataset, offsets as in ``IndexedDataset.doc_offsets``;
        names: what each source is called in metrics; labels: in errors (its path; default the name); weights: the blend's, or None (by size);
        files: where the blend and the permutations are kept (None: built in memory)."""
        if seq_len < 1:
            raise UserError(f"model.seq_len {seq_len} must be positive")
        if seed < 0:
            raise UserError(f"train.seed {seed} must be a non-negative integer")
        self.seq_len = seq_len
        self.seed = seed
        self.names = list(names) or [f"source_{i}" for i in range(len(sources))]
        self.labels = list(labels) or self.names
        w_train, w_val = parse_split(split)
        cuts = [validation_start(offsets, w_train) for _, offsets in sources]
        self.train_streams = [TokenStream([tokens[:cut]]) for (tokens, _), cut in zip(sources, cuts)]
        self.val_streams = [TokenStream([tokens[cut:]]) for (tokens, _), cut in zip(sources, cuts)]
        self.train = TokenStream([tokens[:cut] for (tokens, _), cut in zip(sources, cuts)])
        self.val = TokenStream([tokens[cut:] for (tokens, _), cut in zip(sources, cuts)])
        self.train_sizes = np.array([max(len(t) - 1, 0) // seq_len for t in self.train_streams], dtype=np.int64)
        self.val_sizes = np.array([max(len(t) - 1, 0) // seq_len for t in self.val_streams], dtype=np.int64)
        self.n_train = int(self.train_sizes.sum())
        self.n_val = int(self.val_sizes.sum())
        for k in range(len(sources)):  # a source without validation samples (one document) is only trained on
            if self.train_sizes[k] == 0:
                raise UserError(_too_small(self, [k], sources, split, w_val))
        if w_val > 0 and self.n_val == 0:
            raise UserError(_too_small(self, range(len(sources)), sources, split, w_val))
        self._train_base = np.concatenate([[0], np.cumsum(self.train_sizes)]).astype(np.int64)
        self._val_base = self.n_train + np.concatenate([[0], np.cumsum(self.val_sizes)]).astype(np.int64)
        weights = self.train_sizes.tolist() if weights is None else list(weights)
        counts = block_counts(weights) if len(sources) > 1 else np.array([BLOCK], dtype=np.int64)
        if counts.min() == 0:
            k = int(np.argmin(counts))
            raise UserError(f"{self.labels[k]}: weight {weights[k]:g} is under 1/{BLOCK} of the weights' total "
                            f"{sum(weights):g}, so it would never be drawn; raise it or leave the source out")
        files = files or IndexFiles(None, False)
        self.order = SampleOrder(self.train_sizes.tolist(), counts, seed, files)

    def train_sample_ids(self, global_indices: np.ndarray) -> np.ndarray:
        """Map global train positions (counted across epochs) to sample ids."""
        try:
            source, sample = self.order.locate(np.asarray(global_indices, dtype=np.int64))
        except DamagedIndex as e:
            raise UserError(f"data cache {e}: an index file reads sample ids no source has (damaged after it "
                            "was checked); delete that folder and start again") from None
        return self._train_base[source] + sample

    def source_of(self, ids: np.ndarray) -> np.ndarray:
        """The source each sample id is from."""
        ids = np.asarray(ids, dtype=np.int64)
        train = ids < self.n_train
        out = np.searchsorted(self._train_base, ids, side="right") - 1
        out[~train] = np.searchsorted(self._val_base, ids[~train], side="right") - 1
        return out

    def train_batch_ids(
        self, consumed_samples: int, dp_rank: int, dp: int, micro_batch: int, global_batch: int
    ) -> list[np.ndarray]:
        """Sample ids of this rank's microbatches of the step starting at ``consumed_samples``."""
        if consumed_samples < 0:
            raise UserError(f"consumed_samples {consumed_samples} must be non-negative")
        lo, hi = rank_share(global_batch, dp_rank, dp, micro_batch)
        ids = self.train_sample_ids(np.arange(consumed_samples + lo, consumed_samples + hi))
        return [ids[i : i + micro_batch] for i in range(0, len(ids), micro_batch)]

    def val_batch_ids(
        self, batch_index: int, dp_rank: int, dp: int, micro_batch: int, global_batch: int,
        source: int | None = None,
    ) -> list[np.ndarray]:
        """Validation batch ``b`` is validation samples ``[b*gb, (b+1)*gb)``, wrapping around: every source's
        (source by source), or only ``source``'s."""
        if self.n_val == 0:
            raise UserError("data.split gives validation weight 0, so there are no validation samples")
        if batch_index < 0:
            raise UserError(f"validation batch index {batch_index} must be non-negative")
        if source is not None and self.val_sizes[source] == 0:
            raise UserError(f"{self.labels[source]} has no validation samples (one document, or too few tokens)")
        lo, hi = rank_share(global_batch, dp_rank, dp, micro_batch)
        start = batch_index * global_batch
        base, n = (self.n_train, self.n_val) if source is None else (self._val_base[source], self.val_sizes[source])
        ids = int(base) + (np.arange(start + lo, start + hi, dtype=np.int64) % int(n))
        return [ids[i : i + micro_batch] for i in range(0, len(ids), micro_batch)]

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Tokens of samples ``ids``: shape ``(len(ids), seq_len + 1)``, int64."""
        out = np.empty((len(ids), self.seq_len + 1), dtype=np.int64)
        for row, (sample, k) in enumerate(zip(np.asarray(ids).tolist(), self.source_of(ids).tolist())):
            if sample < self.n_train:
                stream, i = self.train_streams[k], sample - int(self._train_base[k])
            else:
                stream, i = self.val_streams[k], sample - int(self._val_base[k])
            out[row] = stream.window(i * self.seq_len, self.seq_len + 1)
        return out

"""What a run reads from its data: :class:`GPTData`, built by ``megazero.data.build.build_data``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from megazero.data.samples import GPTSamples

if TYPE_CHECKING:  # torch is imported where tensors are made, so preprocessing runs without it
    import torch


@dataclass(frozen=True)
class SourceStamp:
    """One data.paths entry as its dataset was built: what a checkpoint records, for a resume to notice files
    that changed under the same path (``megazero.train.resume_changes``)."""

    path: str  # resolved
    fingerprint: str  # of its files' names, sizes, times and inodes (``cache_plan.files_fingerprint``)
    files: int | None  # how many text files it read (None: a preprocessed dataset)


@dataclass
class GPTData:
    """The samples a run reads; every method is a pure function of its arguments."""

    tokenizer_path: Path
    train_samples: int
    val_samples: int
    seq_len: int
    samples: GPTSamples = field(repr=False, compare=False)
    tokenizer_fingerprint: str | None = None  # of the bytes the tokenizer was loaded from (``content_fingerprint``)
    stamps: tuple[SourceStamp, ...] = ()  # one per data.paths entry, in order
    eos_id: int = -1  # the end-of-text token that closes every document (-1: the tokenizer has none)

    @property
    def source_names(self) -> list[str]:
        """Each source's name (``val_loss/<name>``), in data.paths order."""
        return self.samples.names

    def train_microbatches(
        self, consumed_samples: int, dp_rank: int, dp: int, micro_batch: int, global_batch: int
    ) -> list[torch.Tensor]:
        """This DP rank's microbatches of the step that starts after ``consumed_samples`` samples.

        Each is a LongTensor ``(micro_batch, seq_len + 1)``: inputs ``[:, :-1]``, targets ``[:, 1:]``.
        """
        import torch

        ids = self.samples.train_batch_ids(consumed_samples, dp_rank, dp, micro_batch, global_batch)
        return [torch.from_numpy(self.samples.rows(chunk)) for chunk in ids]

    def val_microbatches(
        self, batch_index: int, dp_rank: int, dp: int, micro_batch: int, global_batch: int,
        source: int | None = None,
    ) -> list[torch.Tensor]:
        """This DP rank's microbatches of validation batch ``batch_index`` (unshuffled, wrapping), of every
        source's validation samples or only ``source``'s."""
        import torch

        ids = self.samples.val_batch_ids(batch_index, dp_rank, dp, micro_batch, global_batch, source)
        return [torch.from_numpy(self.samples.rows(chunk)) for chunk in ids]

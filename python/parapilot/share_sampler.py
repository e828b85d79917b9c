"""ShareBatchSampler: the torch batch sampler that hands each rank its share of every global batch
(shares.py's split_batch of the shares in force).

Contract: the sampler reads the session's active counts (session.config.counts) when each batch
is drawn; it never changes the data order, only which rank reads which slice of each global
batch. Each pass walks one epoch's permutation: the one set_epoch named, else the one after the
previous pass's. It reads, never writes, the session.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, List

import torch
from torch.utils.data import Sampler

if TYPE_CHECKING:
    from .share_session import ShareSession


class ShareBatchSampler(Sampler):
    """Yields this rank's indices of each global batch, split by the session's current shares.

    Every rank walks the same permutation (seeded by seed + epoch) in global batches of
    `global_batch` samples (the last partial batch is dropped); rank r takes the slice that
    split_batch(global_batch, shares)[r] gives it. Shares are read when each batch is drawn, so a
    plan applied at a step boundary splits the next batch (with DataLoader worker processes the
    indices of prefetched batches were already drawn; use num_workers=0, or accept that a share
    change reaches the data a few steps after the gradient weights).
    """

    def __init__(self, dataset_len: int, session: "ShareSession", shuffle: bool = True,
                 seed: int = 0):
        self.n = int(dataset_len)
        self.session = session
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self._epoch_set = True  # the next pass uses self.epoch as it is

    def set_epoch(self, epoch: int) -> None:
        """The next pass walks epoch `epoch`'s permutation (as DistributedSampler.set_epoch).
        Without a call, each pass after the first walks the next epoch's."""
        self.epoch = epoch
        self._epoch_set = True

    def __len__(self) -> int:
        return self.n // self.session.global_batch

    def __iter__(self) -> Iterator[List[int]]:
        if not self._epoch_set:
            self.epoch += 1
        self._epoch_set = False
        b = self.session.global_batch
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        for start in range(0, self.n - b + 1, b):
            counts = self.session.config.counts
            first = sum(counts[:self.session.rank])
            yield order[start + first:start + first + counts[self.session.rank]]

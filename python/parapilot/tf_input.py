"""This worker's share of every global batch as a tf.data pipeline, distributed with
`strategy.distribute_datasets_from_function` (parapilot.tensorflow's input side).

Contract:
* share_dataset(strategy, size, batch_fn, rank, global_batch, counts, shuffle, seed) returns the
  DistributedDataset whose iterator yields, at each step, this worker's slice of that step's
  global batch: every worker walks the same permutation of range(size) (numpy's RandomState(seed
  + epoch), or in order without shuffle) in global batches of `global_batch` indices (the last
  partial one dropped: size // global_batch steps an epoch, then the next epoch, for ever), and
  takes the slice that counts() (the active plan's split_batch counts, read when the batch is
  drawn) gives `rank`. batch_fn(indices: int64 [n]) -> the batch (any structure of tensors whose
  first dimension is n) runs as a tf.data map on this worker.
* Nothing is drawn ahead: the pipeline has no prefetch (tf.data's autotune and injected prefetch
  are off, and the distributed iterator's per-replica buffer is 0), so the batch of step t is
  drawn when the step calls next() on the iterator, after the boundary that applied step t's
  plan. A batch_fn with its own prefetch or parallel map would draw ahead and split those batches
  with the shares of the step that drew them.
* The stream is infinite (its cardinality says so), so MultiWorkerMirroredStrategy does not
  synchronise the workers at every next() to find out whether all of them still have data:
  every worker runs the same number of steps because the script says how many.
Pure apart from reading counts(); raises ValueError for a size below one global batch.
"""

from __future__ import annotations

from typing import Callable, Iterator, List

import numpy as np
import tensorflow as tf


def share_indices(size: int, rank: int, global_batch: int, counts: Callable[[], List[int]],
                  shuffle: bool = True, seed: int = 0) -> Iterator[np.ndarray]:
    """The index generator behind share_dataset: this rank's slice of each global batch, epoch
    after epoch (see the module docstring)."""
    epoch = 0
    while True:
        if shuffle:
            order = np.random.RandomState(seed + epoch).permutation(size)
        else:
            order = np.arange(size)
        for start in range(0, size - global_batch + 1, global_batch):
            c = counts()
            first = start + sum(c[:rank])
            yield order[first:first + c[rank]].astype(np.int64)
        epoch += 1


def share_dataset(strategy: tf.distribute.Strategy, size: int, batch_fn: Callable,
                  rank: int, global_batch: int, counts: Callable[[], List[int]],
                  shuffle: bool = True, seed: int = 0) -> tf.distribute.DistributedDataset:
    """The distributed dataset of this worker's shares (see the module docstring)."""
    if size < global_batch:
        raise ValueError(f"a dataset of {size} examples holds no global batch of {global_batch}")

    def dataset_fn(_context: tf.distribute.InputContext) -> tf.data.Dataset:
        ds = tf.data.Dataset.from_generator(
            lambda: share_indices(size, rank, global_batch, counts, shuffle, seed),
            output_signature=tf.TensorSpec([None], tf.int64))
        ds = ds.map(batch_fn)
        ds = ds.apply(tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY))
        options = tf.data.Options()
        options.autotune.enabled = False
        options.experimental_optimization.inject_prefetch = False
        return ds.with_options(options)

    return strategy.distribute_datasets_from_function(
        dataset_fn, tf.distribute.InputOptions(experimental_fetch_to_device=False,
                                               experimental_per_replica_buffer_size=0))

"""What parapilot.tensorflow times and runs among the workers of a
MultiWorkerMirroredStrategy: the gradient all-reduce's wait, and the boundary agreement's two
reductions.

Contract:
* GradientTimer(strategy, optimizer) wraps the optimizer's own gradient all-reduce on this
  instance: Keras 3's `_all_reduce_sum_gradients` or tf_keras's `aggregate_gradients` (the
  method each calls from apply_gradients in a replica context; both SUM the gradients over the
  replicas). Inside the traced step it adds two `tf.timestamp()` ops: one once every gradient
  is computed (the all-reduce's inputs wait for it) and one once every reduced gradient exists
  (the optimizer's update waits for it), and writes both to a per-worker variable. read()
  returns them (seconds since the epoch, as time.time()) after the step ran, or None before any
  step. The wrapper must be in place before the step function is traced (Session's constructor
  does it). An optimizer with neither method raises TypeError. restore() puts the method back.
* Control(strategy) runs the boundary agreement's reductions as an all-gather of a small int64
  vector over the workers (MultiWorkerMirroredStrategy's collective ops; the strategy offers only
  SUM and MEAN reductions), reduced on the host: max_of(values) and min_of(value). Each is one
  collective every worker must call in the same order; a failure is TensorFlow's error. `calls`
  and `bytes` count the all-gathers run and the bytes this worker contributed to them.
Thread-safety: the training thread's.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import tensorflow as tf

# The optimizer methods that all-reduce the gradients, by Keras flavour.
_REDUCERS = ("_all_reduce_sum_gradients",  # Keras 3 (keras.src.backend.tensorflow.optimizer)
             "aggregate_gradients")        # tf_keras (Keras 2) optimizers


class GradientTimer:
    """Times the optimizer's gradient all-reduce (see the module docstring)."""

    def __init__(self, strategy: tf.distribute.Strategy, optimizer):
        self._strategy = strategy
        self._optimizer = optimizer
        name = next((n for n in _REDUCERS if callable(getattr(optimizer, n, None))), None)
        if name is None:
            raise TypeError(f"{type(optimizer).__name__} has no gradient all-reduce that "
                            "parapilot can time (a Keras 3 or tf_keras optimizer has one)")
        self._name = name
        with tf.init_scope():
            self._stamps = tf.Variable(tf.zeros([2], tf.float64), trainable=False,
                                       synchronization=tf.VariableSynchronization.ON_READ,
                                       aggregation=tf.VariableAggregation.NONE,
                                       name="parapilot_gradient_stamps")
        original = getattr(optimizer, name)
        self._original = original
        stamps = self._stamps

        def timed(grads_and_vars, *args, **kwargs):
            pairs = list(grads_and_vars)
            grads = [g for g, _ in pairs if g is not None]
            with tf.control_dependencies(grads):
                ready = tf.timestamp()
            with tf.control_dependencies([ready]):
                pairs = [(tf.identity(g) if g is not None else g, v) for g, v in pairs]
            out = list(original(pairs, *args, **kwargs))
            with tf.control_dependencies([g for g, _ in out if g is not None]):
                reduced = tf.timestamp()
            write = stamps.assign(tf.stack([ready, reduced]))
            with tf.control_dependencies([write]):
                return [(tf.identity(g) if g is not None else g, v) for g, v in out]
        setattr(optimizer, name, timed)

    @property
    def method(self) -> str:
        """The optimizer method that is timed."""
        return self._name

    def read(self) -> Optional[Tuple[float, float]]:
        """(all gradients ready, all reduced) of the last step that reduced, in seconds since
        the epoch; None before the first."""
        ready, reduced = self._strategy.experimental_local_results(self._stamps)[0].numpy()
        return None if ready == 0 else (float(ready), float(reduced))

    def restore(self) -> None:
        """Unwraps the optimizer (a step traced before keeps the timing ops)."""
        if self._original is not None:
            setattr(self._optimizer, self._name, self._original)
            self._original = None


class Control:
    """The boundary agreement's reductions over the workers (see the module docstring)."""

    def __init__(self, strategy: tf.distribute.Strategy):
        self._strategy = strategy
        self.calls = 0
        self.bytes = 0

        @tf.function
        def gather(v):
            def replica(x):
                return tf.distribute.get_replica_context().all_gather(x[None, :], axis=0)
            return strategy.run(replica, args=(v,))
        self._gather = gather

    def _all(self, values: List[int]) -> List[List[int]]:
        self.calls += 1
        self.bytes += 8 * len(values)
        out = self._gather(tf.constant(values, tf.int64))
        return self._strategy.experimental_local_results(out)[0].numpy().tolist()

    def max_of(self, values: List[int]) -> List[int]:
        """Element-wise MAX of `values` (the same length on every worker) over the workers."""
        rows = self._all(values)
        return [max(col) for col in zip(*rows)]

    def min_of(self, value: int) -> int:
        """MIN of `value` over the workers."""
        return min(row[0] for row in self._all([value]))

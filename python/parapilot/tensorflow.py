"""TensorFlow integration: a tf.distribute.MultiWorkerMirroredStrategy job reports per-step
telemetry to the parapilot agent and takes its per-worker batch shares (docs/tensorflow.md).
No torch import: the agent link (agent_link.py), the plan book (plans.py), the boundary
agreement (boundary.py), the shares' rounding (shares.py) and the wire format are the ones the
PyTorch sessions use.

    strategy = tf.distribute.MultiWorkerMirroredStrategy()      # TF_CONFIG names the workers
    with strategy.scope():
        model = ...; optimizer = keras.optimizers.SGD(0.1)
    session = parapilot.tensorflow.Session(strategy, model, optimizer, global_batch=256)
    iterator = iter(session.distribute_dataset(len(x), lambda i: (tf.gather(x, i),
                                                                  tf.gather(y, i))))

    @tf.function
    def train_step(iterator):
        def step_fn(x, y):
            with tf.GradientTape() as tape:
                loss = session.scale_loss(loss_fn(y, model(x, training=True)))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(step_fn, args=next(iterator))

    for _ in range(steps):
        with session.step():
            train_step(iterator)
        if session.should_stop:
            break
    session.close()

Contract:
* Session(strategy, model, optimizer, global_batch=...) needs a MultiWorkerMirroredStrategy
  with one replica per worker (workers as processes, on CPUs or one device each); its rank is
  the worker's task index. It wraps the optimizer's gradient all-reduce to time it
  (tf_collectives.GradientTimer; create the Session before the step function is first traced)
  and never changes the model, the loss, the optimizer or the data order.
* distribute_dataset(size, batch_fn) is this worker's input pipeline: its share of every global
  batch (tf_input.py), under the shares of the plan in force when the step draws it.
* scale_loss(per_example_loss) is the loss to differentiate: the per-example losses summed over
  this worker's examples and divided by the global batch (tf.nn.compute_average_loss with
  global_batch_size), so that the strategy's SUM all-reduce of the gradients (what the Keras
  optimizers do in a replica context) gives the gradient of the mean loss over the whole global
  batch, however it is split.
* `with session.step():` wraps one training step. Its cycle runs from the end of the previous
  step to the end of this one (drawing the batch belongs to the step that draws it); on exit the
  step's Telemetry is sent and, at the boundary, the workers agree on a committed plan and on
  stopping (boundary.py; both reductions are all-gathers among the workers, run synchronously
  at the boundary; the time spent in them is the next step's wait/other and all_reduce/control).
  `with session.outside_steps():` marks work that is no training step (charged to no step).
* Keras's model.fit (tf_keras, Keras 2: Keras 3's fit fails under this strategy, with or
  without parapilot): compile with loss=session.keras_loss(per_example_loss) (reduction "sum",
  divided by the global batch: scale_loss's rule) and fit on distribute_dataset(...) with
  steps_per_epoch and callbacks=[session.keras_callback()], which makes each training batch a
  step, the time between epochs no step's, and stops the fit when the workers agreed to stop.
* Telemetry: compute = cycle - wait/dp - wait/other; wait/dp (= phase/comm_wait) = from every
  gradient being computed to every gradient being reduced, measured inside the step with
  tf.timestamp(); arrive/dp = cycle start -> gradients computed; all_reduce/dp: that span, the
  gradient bytes, 1 call; info/plan, info/samples.
* Plans: pure data-parallel layouts of the job's size (shares.dp_layout_problem), without
  gradient compression; anything else is refused with the reason. A worker whose strategy fails
  in a collective (a peer gone) raises TensorFlow's error from the step.
* Everything the session says goes, one line each prefixed "rank R: ", to `log` (default: the
  logging module's "parapilot" logger). close() sends what is pending, logs the summary line and
  disconnects; the optimizer's timing wrapper is removed; the last plan stays in force.
Thread-safety: a session belongs to the training thread; bus messages are handled on the
client's I/O thread (staging only builds new objects).
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence

import tensorflow as tf

from . import telemetry_keys as keys, wire
from .agent_link import AgentLink, announcement, summary_line
from .boundary import Boundary
from .client import logging_logger
from .shares import dp_layout_problem, plan_shares, split_batch
from .tf_collectives import Control, GradientTimer
from .tf_input import share_dataset

__all__ = ["Session"]

JOB_KIND = "TensorFlow"


@dataclass(frozen=True)
class SharePlan:
    """A plan as this job runs it: its shares and the samples per worker they give."""
    plan_id: int = 0
    shares: List[int] = field(default_factory=list)  # empty: even
    counts: List[int] = field(default_factory=list)  # split_batch(global batch, shares)
    name: str = "initial"


@dataclass
class _Step:
    step: int
    plan_id: int
    samples: int
    start_ns: int = 0
    end_ns: int = 0
    control: tuple = (0.0, 0, 0)  # the boundary before this step: ms, all-gathers, bytes


class Session:
    """Connects a MultiWorkerMirroredStrategy job to the parapilot agent. See the module
    docstring.

    strategy: the job's tf.distribute.MultiWorkerMirroredStrategy.
    model: the Keras model (its layers are the agent's layers; read for sizes only).
    optimizer: the Keras 3 or tf_keras optimizer that applies the gradients in the step.
    global_batch: samples per step over all workers (what the shares split).
    initial_shares: the shares before any plan (default: even).
    agent, secret_file, secret_env, client_options: the agent link (agent_link.py; default
        address: env PARAPILOT_AGENT, empty or unset: no agent).
    log: a (level, line) callable (default: the "parapilot" logger).
    """

    def __init__(self, strategy: tf.distribute.Strategy, model, optimizer, *,
                 global_batch: int, initial_shares: Optional[Sequence[int]] = None,
                 agent: Optional[str] = None, secret_file: Optional[str] = None,
                 secret_env: str = "PARAPILOT_SECRET", client_options: Optional[dict] = None,
                 log: Optional[Callable[[str, str], None]] = None):
        if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
            raise ValueError(f"parapilot.tensorflow.Session needs a MultiWorkerMirroredStrategy, "
                             f"not {type(strategy).__name__}")
        resolver = strategy.cluster_resolver
        workers = len(resolver.cluster_spec().as_dict().get("worker", [])) if resolver else 0
        self.world_size = strategy.num_replicas_in_sync
        if workers not in (0, self.world_size):
            raise ValueError(f"{self.world_size} replicas on {workers} workers: the session "
                             "needs one replica per worker (one device or the CPU each)")
        self.strategy = strategy
        self.rank = int(resolver.task_id) if resolver and resolver.task_id is not None else 0
        self.global_batch = int(global_batch)
        if self.global_batch < self.world_size:
            raise ValueError(f"global_batch {global_batch} < world size {self.world_size}")
        self.model = model
        self.optimizer = optimizer
        self.framework = f"tensorflow {tf.__version__}"
        self._log = log or logging_logger(logging.getLogger("parapilot"))
        self.step_index = 0
        self.should_stop = False
        self.stop_reason: Optional[str] = None
        self.applied_plans: List[int] = []
        self.last_telemetry: Optional[wire.Telemetry] = None
        self.config = self._share_plan(0, list(initial_shares or []), "initial")
        self._refused: List[int] = []
        self._cycles_ms: List[float] = []
        self._prev_end_ns: Optional[int] = None
        self._control = (0.0, 0, 0)  # the last boundary's reductions: ms, calls, bytes
        self._record: Optional[_Step] = None
        self._closed = False
        self._layers = self._layer_infos()
        self._grad_bytes = sum(l.grad_bytes for l in self._layers)
        self._timer = GradientTimer(strategy, optimizer)
        self._reduce = Control(strategy)
        self.link = AgentLink(self.rank, job_info=self.job_info, check=self._check,
                              stage=self._stage, say=self._say, agent=agent,
                              secret_file=secret_file, secret_env=secret_env,
                              client_options=client_options)
        self._agreement = Boundary(self.link.book, self._start_max, self._reduce.min_of)
        params = sum(l.params for l in self._layers)
        self._say("info", f"session started: world size {self.world_size}, global batch "
                          f"{self.global_batch}, {len(self._layers)} layers ({params:,} "
                          f"parameters), {self.link.where()}")
        self.link.start()

    # ---- public API ----

    @property
    def plan_id(self) -> int:
        return self.config.plan_id

    @property
    def shares(self) -> List[int]:
        return list(self.config.shares)

    def local_counts(self) -> List[int]:
        """Samples per worker in the current step's global batch."""
        return list(self.config.counts)

    @property
    def local_batch(self) -> int:
        return self.config.counts[self.rank]

    def distribute_dataset(self, size: int, batch_fn: Callable, shuffle: bool = True,
                           seed: int = 0) -> tf.distribute.DistributedDataset:
        """This worker's share of every global batch of a dataset of `size` examples, drawn by
        index: batch_fn(indices) -> the batch (tf_input.py). size // global_batch steps make an
        epoch; the stream goes on with the next epoch's permutation."""
        return share_dataset(self.strategy, size, batch_fn, self.rank, self.global_batch,
                             lambda: self.config.counts, shuffle=shuffle, seed=seed)

    def scale_loss(self, per_example_loss: tf.Tensor) -> tf.Tensor:
        """The per-example losses of this worker's batch summed and divided by the global batch
        (call inside the replica function)."""
        return tf.nn.compute_average_loss(per_example_loss, global_batch_size=self.global_batch)

    @contextlib.contextmanager
    def step(self):
        """Wraps one training step (see the module docstring)."""
        self._begin()
        try:
            yield self
        except BaseException:
            self._record = None
            raise
        self._end()

    @contextlib.contextmanager
    def outside_steps(self):
        """Wraps work between steps that is no training (an evaluation, a checkpoint): the next
        step's cycle starts when it ends."""
        try:
            yield self
        finally:
            self._prev_end_ns = None
            self._control = (0.0, 0, 0)

    def keras_loss(self, per_example_loss: Callable):
        """For Keras's model.fit: a Loss (of the model's Keras, reduction "sum") whose value is
        per_example_loss(y_true, y_pred) (a Keras loss with reduction "none", or a function
        giving one loss per example) summed over this worker's examples and divided by the
        global batch: what scale_loss does in a custom loop."""
        keras = _keras_of(self.model)
        global_batch = self.global_batch

        class GlobalBatchLoss(keras.losses.Loss):
            def __init__(self):
                super().__init__(reduction="sum", name="global_batch_loss")

            def call(self, y_true, y_pred):
                per_example = per_example_loss(y_true, y_pred)
                return per_example / tf.cast(global_batch, per_example.dtype)
        return GlobalBatchLoss()

    def keras_callback(self):
        """For Keras's model.fit: a Callback (of the model's Keras) that makes each training
        batch a step() (on_train_batch_begin/end), marks the time between epochs as outside
        the steps, and sets model.stop_training when the workers agreed to stop."""
        keras = _keras_of(self.model)
        session = self

        class StepCallback(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                session._begin()

            def on_train_batch_end(self, batch, logs=None):
                session._end()
                if session.should_stop:
                    self.model.stop_training = True

            def on_epoch_end(self, epoch, logs=None):
                session._prev_end_ns = None
                session._control = (0.0, 0, 0)
        return StepCallback()

    def job_info(self, max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES) -> wire.JobInfo:
        """The JobInfo this worker announces on each connection (as many layers as fit)."""
        return announcement(self.rank, self.world_size, self.global_batch,
                            wire.Capability.DP_SHARES, self.framework, self._layers,
                            max_frame_bytes)

    def close(self, flush_timeout: float = 2.0) -> None:
        """Logs the summary, sends what is pending and disconnects; unwraps the optimizer.
        Every worker must call it (the pending agreement is finished first). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._agreement.finish()
        self._timer.restore()
        self._say("info", self._summary())
        self.link.close(flush_timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the step ----

    def _begin(self) -> None:
        if self._closed:
            raise RuntimeError("parapilot.tensorflow.Session: a step after close()")
        now = time.time_ns()
        self._record = _Step(self.step_index, self.plan_id, self.local_batch,
                             start_ns=self._prev_end_ns if self._prev_end_ns is not None else now,
                             control=self._control)

    def _end(self) -> None:
        rec, self._record = self._record, None
        if rec is None:
            return
        rec.end_ns = time.time_ns()
        self._prev_end_ns = rec.end_ns
        self._cycles_ms.append((rec.end_ns - rec.start_ns) / 1e6)
        self.step_index += 1
        t = self._telemetry(rec, self._timer.read())
        self.last_telemetry = t
        self.link.send(t)
        t0, calls, nbytes = time.perf_counter_ns(), self._reduce.calls, self._reduce.bytes
        self._boundary(self.step_index)
        self._control = ((time.perf_counter_ns() - t0) / 1e6, self._reduce.calls - calls,
                         self._reduce.bytes - nbytes)

    # ---- the boundary ----

    def _start_max(self, values: List[int]) -> Callable[[], List[int]]:
        reduced = self._reduce.max_of(values)  # synchronous: collected at the next boundary
        return lambda: reduced

    def _boundary(self, next_step: int) -> None:
        out = self._agreement.at(next_step, self.plan_id, f"rank {self.rank}: ")
        if out.stop and not self.should_stop:
            self.should_stop = True
            self.stop_reason = self.link.book.stop_reason or "another worker was asked to stop"
        if out.missed:
            self._refused.append(out.missed)
            self._say("warn", f"plan {out.missed} refused: committed but not staged on every "
                              f"worker; staying on plan {self.plan_id}")
        if out.apply is not None:
            cfg: SharePlan = out.apply.staged
            self.config = cfg
            self.applied_plans.append(cfg.plan_id)
            shares = ",".join(str(x) for x in cfg.shares) if cfg.shares else "even"
            self._say("info", f"plan {cfg.plan_id} applied at step {self.step_index}: this "
                              f"worker takes {cfg.counts[self.rank]} of {self.global_batch} "
                              f"samples (shares {shares})")

    # ---- plans (the bus client's I/O thread) ----

    def _check(self, p: wire.PlanPrepare) -> str:
        why = dp_layout_problem(p, self.world_size, JOB_KIND)
        if not why and any(c.method != 0 for c in p.layout.compression):
            why = "this TensorFlow job does not compress gradients (capability: batch shares)"
        if why:
            self._refused.append(p.plan_id)
            self._say("warn", f"plan {p.plan_id} refused: {why}")
        return why

    def _stage(self, p: wire.PlanPrepare) -> SharePlan:
        return self._share_plan(p.plan_id, plan_shares(p), p.layout_name)

    def _share_plan(self, plan_id: int, shares: List[int], name: str) -> SharePlan:
        eff = shares or [1] * self.world_size
        if len(eff) != self.world_size:
            raise ValueError(f"{len(eff)} shares for {self.world_size} workers")
        return SharePlan(plan_id, list(shares), split_batch(self.global_batch, eff), name)

    # ---- telemetry ----

    def _telemetry(self, rec: _Step, stamps) -> wire.Telemetry:
        cycle = max(0.0, (rec.end_ns - rec.start_ns) / 1e6)

        def at(seconds: float) -> float:  # ms since the cycle start, within the cycle
            return min(max(seconds * 1e3 - rec.start_ns / 1e6, 0.0), cycle)
        if stamps is not None and at(stamps[0]) > 0.0:
            arrive, wait = at(stamps[0]), max(at(stamps[1]) - at(stamps[0]), 0.0)
        else:  # no gradient reduction seen in this cycle
            arrive, wait = cycle, 0.0
        control_ms, control_calls, control_bytes = rec.control
        other = min(control_ms, cycle - wait)
        coll = {
            keys.ALL_REDUCE_DP: wire.CollectiveStat(wait, self._grad_bytes, 1 if wait else 0),
            keys.ALL_REDUCE_CONTROL: wire.CollectiveStat(other, control_bytes, control_calls),
            keys.WAIT_DP: wire.CollectiveStat(wait, 0, 1),
            keys.WAIT_OTHER: wire.CollectiveStat(other, 0, 1),
            keys.PHASE_COMM_WAIT: wire.CollectiveStat(wait, 0, 1),
            keys.ARRIVE_DP: wire.CollectiveStat(arrive, 0, 1),
        }
        for s in coll.values():
            s.ms = min(max(s.ms, 0.0), cycle, wire.MAX_DURATION_MS)
        t = wire.Telemetry(rank=self.rank, step=rec.step, step_start_ns=rec.start_ns,
                           step_end_ns=max(rec.end_ns, rec.start_ns), send_time_ns=time.time_ns(),
                           compute_ms=max(cycle - wait - other, 0.0), queue_depth=0,
                           collectives=coll, layers=[])
        keys.set_info(t, keys.PLAN, rec.plan_id)
        keys.set_info(t, keys.SAMPLES, rec.samples)
        return t

    # ---- what the session says ----

    def _say(self, level: str, text: str) -> None:
        self._log(level, f"rank {self.rank}: {text}")

    def _summary(self) -> str:
        median = statistics.median(self._cycles_ms) if self._cycles_ms else 0.0
        return summary_line(len(self._cycles_ms), median, self.applied_plans,
                            len(self._refused),
                            f"final share {self.local_batch}/{self.global_batch}",
                            self.link.describe())

    def _layer_infos(self) -> List[wire.LayerInfo]:
        """Per Keras layer with weights: its parameters and its trainable weights' bytes."""
        out: List[wire.LayerInfo] = []
        for layer in _weighted_layers(self.model):
            params = sum(int(_size(w)) for w in layer.weights)
            grad = sum(int(_size(w)) * _itemsize(w) for w in layer.trainable_weights)
            out.append(wire.LayerInfo(params, grad))
        return out[:wire.MAX_LAYERS]


def _keras_of(model):
    """The Keras package the model belongs to: tf_keras (Keras 2) or keras (Keras 3)."""
    if type(model).__module__.startswith("tf_keras"):
        import tf_keras
        return tf_keras
    import keras
    return keras


def _weighted_layers(model) -> List[Any]:
    layers = getattr(model, "layers", None)
    if not layers:
        return [model]
    return [l for l in layers if l.weights]


def _size(w) -> int:
    n = 1
    for d in w.shape:
        n *= int(d)
    return n


def _itemsize(w) -> int:
    return tf.as_dtype(w.dtype).size

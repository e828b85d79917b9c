"""TensorFlow MultiWorkerMirroredStrategy jobs with parapilot.tensorflow, for test_tensorflow.py.
Launch with `python -m parapilot.launch --tf-config --nproc 4 tests/python/tf_job.py ...`; one
launch runs several jobs one after another (one strategy per process, a fresh model, optimizer,
Session and dataset each), so TensorFlow starts once.

--runs exact: the exactness job (float64): uneven initial shares 1,2,3,4, plain SGD; rank 0 also
  trains a copy of the model on the whole global batch in one process (the same examples, the
  mean loss) and records, after every step, the largest difference between the two models'
  weights. The job runs until a plan from the agent (PARAPILOT_AGENT, the test's scripted agent)
  has applied and AFTER_PLAN steps more (at most --steps), stepping --step-sleep-ms apart so the
  test can commit one. Worker SLOW_RANK sleeps --slow-ms more inside every step (after drawing its
  batch, before its gradients), for the test of what the telemetry attributes.
--runs CONDITION:MODE[:STEPS],...: timed jobs (float32) on an emulated device (job_shapes.py's
  idea): every worker sleeps DEVICE_MS per sample inside its step (a device computes without
  taking the host's CPU, so 4 workers on 2 cores do not slow each other through it). CONDITION:
  healthy; step: worker SLOW_RANK sleeps FACTOR x as long in its step; input: worker SLOW_RANK
  sleeps (FACTOR - 1) x DEVICE_MS per sample more in its input pipeline (batch_fn). MODE: agent
  (the next address of --agents) or none; STEPS: --steps with an agent, --baseline-steps without.
Rank 0 writes --out: per run its condition, mode, step wall times (ms), final samples per worker,
plans applied, and for `exact` the per-step differences and samples.
"""

import argparse
import json
import logging
import os
import time

import numpy as np
import tensorflow as tf

import parapilot.tensorflow  # parapilot
from parapilot.tf_input import share_indices

SLOW_RANK = 2
FACTOR = 3.0
DEVICE_MS = 1.0
SIZE, FEATURES, CLASSES = 4096, 16, 4
AFTER_PLAN = 8
LEGACY = os.environ.get("TF_USE_LEGACY_KERAS") == "1"  # tf.keras is tf_keras (Keras 2)


def make_model(dtype):
    model = tf.keras.Sequential([tf.keras.Input((FEATURES,), dtype=dtype),
                                 tf.keras.layers.Dense(32, activation="relu", dtype=dtype),
                                 tf.keras.layers.Dense(CLASSES, dtype=dtype)])
    return model


def data(dtype):
    rs = np.random.RandomState(7)
    x = rs.randn(SIZE, FEATURES).astype(dtype)
    y = (x[:, :CLASSES].argmax(1) + rs.randint(0, 2, SIZE)) % CLASSES
    return tf.constant(x), tf.constant(y.astype(np.int64))


def sleep_ms(ms):
    """A graph op that sleeps `ms` (a float tensor) milliseconds; returns 0."""
    def fn(v):
        time.sleep(max(float(v), 0.0) / 1000.0)
        return np.float32(0.0)
    return tf.py_function(fn, [tf.cast(ms, tf.float32)], tf.float32)


def sparse_ce(dtype, **kwargs):
    """Sparse cross-entropy on logits in `dtype` (Keras 3 losses compute in floatx, float32,
    unless told the dtype; tf_keras ones in their inputs' dtype and take no dtype)."""
    if not LEGACY:
        kwargs["dtype"] = dtype
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, **kwargs)


class Job:
    """One job of a launch: model, optimizer, Session, data and the emulated device."""

    def __init__(self, strategy, a, condition, agent, rank):
        self.condition, self.rank, self.a = condition, rank, a
        self.dtype = "float64" if condition == "exact" else "float32"
        tf.keras.utils.set_random_seed(3)
        with strategy.scope():
            self.model = make_model(self.dtype)
            self.optimizer = tf.keras.optimizers.SGD(0.5 if condition == "exact" else 0.05)
        self.x, self.y = data(self.dtype)
        shares = [1, 2, 3, 4] if condition == "exact" else None
        self.session = parapilot.tensorflow.Session(  # parapilot
            strategy, self.model, self.optimizer, global_batch=a.global_batch,
            initial_shares=shares, agent=agent)
        slow = rank == SLOW_RANK
        self.input_extra = (FACTOR - 1) * DEVICE_MS if slow and condition == "input" else 0.0
        step_factor = FACTOR if slow and condition == "step" else 1.0
        self.step_ms_per_sample = 0.0 if condition == "exact" else DEVICE_MS * step_factor
        self.fixed_ms = a.slow_ms if slow and condition == "exact" else 0.0
        self.drawn = []  # the size of every batch this worker's pipeline drew, in order
        self.dataset = self.session.distribute_dataset(SIZE, self.batch_fn, seed=11)
        self.ref = (Reference(self.model, self.x, self.y, a.global_batch)
                    if condition == "exact" and rank == 0 else None)
        self.step_ms, self.diffs = [], []
        self.applied_at = None

    def batch_fn(self, idx):
        n = tf.cast(tf.size(idx), tf.float32)
        marks = [tf.py_function(lambda v: self.drawn.append(int(v)) or np.float32(0), [n],
                                tf.float32)]
        if self.input_extra:
            marks.append(sleep_ms(self.input_extra * n))
        with tf.control_dependencies(marks):
            return tf.identity(tf.gather(self.x, idx)), tf.gather(self.y, idx)

    def device(self, xb):
        """xb once the emulated device's time for the batch has been slept."""
        n = tf.cast(tf.shape(xb)[0], tf.float32)
        with tf.control_dependencies([sleep_ms(self.step_ms_per_sample * n + self.fixed_ms)]):
            return tf.identity(xb)

    def after_step(self, i, t0):
        """Records step i; True when the job is done (the exact job: AFTER_PLAN steps after
        its plan applied, the same step on every worker)."""
        self.step_ms.append((time.perf_counter() - t0) * 1e3)
        if self.ref is not None:
            self.diffs.append(self.ref.step_and_compare(self.model))
        if self.condition == "exact":
            if self.session.applied_plans and self.applied_at is None:
                self.applied_at = i
            if self.applied_at is not None and i >= self.applied_at + AFTER_PLAN:
                return True
            time.sleep(self.a.step_sleep_ms / 1000.0)
        return self.session.should_stop  # parapilot

    def result(self, agent):
        s = self.session
        return {"condition": self.condition, "mode": "agent" if agent else "none",
                "step_ms": self.step_ms, "final_counts": s.local_counts(),
                "plans": list(s.applied_plans), "samples": self.drawn[:len(self.step_ms)],
                "diffs": self.diffs}


def custom_loop(strategy, job, steps):
    """The job in a custom training loop (strategy.run)."""
    model, optimizer, session = job.model, job.optimizer, job.session
    loss_fn = sparse_ce(job.dtype, reduction="none")
    iterator = iter(job.dataset)

    @tf.function
    def train_step(iterator):
        def step_fn(xb, yb):
            xb = job.device(xb)
            with tf.GradientTape() as tape:
                loss = session.scale_loss(loss_fn(yb, model(xb, training=True)))  # parapilot
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(step_fn, args=next(iterator))

    for i in range(steps):
        t0 = time.perf_counter()
        with session.step():  # parapilot
            train_step(iterator)
        if job.after_step(i, t0):
            break


def keras_fit(strategy, job, steps):
    """The job in Keras's model.fit (tf_keras: TF_USE_LEGACY_KERAS=1)."""
    session = job.session
    per_example = sparse_ce(job.dtype, reduction="none")
    model = job.model

    class Device(tf.keras.layers.Layer):  # the emulated device, inside the step
        def call(self, xb):
            return job.device(xb)
    with strategy.scope():
        fit_model = tf.keras.Sequential([tf.keras.Input((FEATURES,), dtype=job.dtype),
                                         Device(dtype=job.dtype), model])
        fit_model.compile(optimizer=job.optimizer,
                          loss=session.keras_loss(per_example))  # parapilot

    class Record(tf.keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            if job.after_step(len(job.step_ms), self.t0):
                self.model.stop_training = True
    fit_model.fit(job.dataset, steps_per_epoch=steps, epochs=1, verbose=0,
                  callbacks=[session.keras_callback(), Record()])  # parapilot


def run_job(strategy, a, condition, agent, steps, rank):
    job = Job(strategy, a, condition, agent, rank)
    if a.fit:
        keras_fit(strategy, job, steps)
    else:
        custom_loop(strategy, job, steps)
    result = job.result(agent)
    job.session.close()  # parapilot
    return result


class Reference:
    """The same model trained in this process on the whole global batch (the mean loss, plain
    SGD written out), for the exactness job."""

    def __init__(self, model, x, y, global_batch):
        self.weights = [w.numpy().copy() for w in model.trainable_variables]
        self.x, self.y, self.lr = x, y, 0.5
        self.model = make_model("float64")
        self.model.set_weights(model.get_weights())
        self.order = share_indices(SIZE, 0, global_batch, lambda: [global_batch], True, 11)
        self.loss_fn = sparse_ce("float64", reduction="none")

    def step_and_compare(self, model):
        idx = next(self.order)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(self.loss_fn(tf.gather(self.y, idx),
                                               self.model(tf.gather(self.x, idx))))
        grads = tape.gradient(loss, self.model.trainable_variables)
        for w, g in zip(self.model.trainable_variables, grads):
            w.assign_sub(self.lr * g)
        return max(float(np.max(np.abs(a.numpy() - b.numpy())))
                   for a, b in zip(self.model.trainable_variables, model.trainable_variables))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", required=True)
    ap.add_argument("--agents", default="")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--baseline-steps", type=int, default=50)
    ap.add_argument("--global-batch", type=int, default=128)
    ap.add_argument("--step-sleep-ms", type=float, default=30)
    ap.add_argument("--slow-ms", type=float, default=0)
    ap.add_argument("--fit", action="store_true",
                    help="train with Keras's model.fit (needs TF_USE_LEGACY_KERAS=1: tf_keras)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    logging.basicConfig(format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("parapilot").setLevel(logging.INFO)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.task_id
    agents = [s for s in a.agents.split(",") if s]
    results = []
    for spec in a.runs.split(","):
        condition, mode, *n = spec.split(":") + ([] if ":" in spec else ["none"])
        if condition == "exact":
            agent, steps = None, a.steps  # the exact job takes PARAPILOT_AGENT
        elif mode == "agent":
            agent, steps = agents.pop(0), a.steps
        else:
            agent, steps = "", a.baseline_steps
        if n:
            steps = int(n[0])
        results.append(run_job(strategy, a, condition, agent, steps, rank))
    if rank == 0 and a.out:
        with open(a.out, "w") as f:
            json.dump({"runs": results}, f)


if __name__ == "__main__":
    main()

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


def run_job(strategy, a, condition, agent, steps, rank):
    dtype = "float64" if condition == "exact" else "float32"
    tf.keras.utils.set_random_seed(3)
    with strategy.scope():
        model = make_model(dtype)
        optimizer = tf.keras.optimizers.SGD(0.5 if condition == "exact" else 0.05)
    x, y = data(dtype)
    shares = [1, 2, 3, 4] if condition == "exact" else None
    session = parapilot.tensorflow.Session(strategy, model, optimizer,  # parapilot
                                           global_batch=a.global_batch, initial_shares=shares,
                                           agent=agent)
    slow = rank == SLOW_RANK
    step_factor = FACTOR if slow and condition == "step" else 1.0
    input_extra = (FACTOR - 1) * DEVICE_MS if slow and condition == "input" else 0.0
    device_ms = DEVICE_MS if condition != "exact" else 0.0
    fixed_ms = a.slow_ms if slow and condition == "exact" else 0.0

    def batch_fn(idx):
        xb, yb = tf.gather(x, idx), tf.gather(y, idx)
        if input_extra:
            with tf.control_dependencies([sleep_ms(input_extra * tf.cast(tf.size(idx),
                                                                         tf.float32))]):
                xb = tf.identity(xb)
        return xb, yb

    iterator = iter(session.distribute_dataset(SIZE, batch_fn, seed=11))
    # Keras 3 losses compute in floatx (float32) unless told the dtype.
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none",
                                                            dtype=dtype)

    @tf.function
    def train_step(iterator):
        def step_fn(xb, yb):
            n = tf.cast(tf.shape(xb)[0], tf.float32)
            with tf.control_dependencies([sleep_ms(device_ms * step_factor * n + fixed_ms)]):
                xb = tf.identity(xb)
            with tf.GradientTape() as tape:
                loss = session.scale_loss(loss_fn(yb, model(xb, training=True)))  # parapilot
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return tf.shape(xb)[0]
        return strategy.run(step_fn, args=next(iterator))

    ref = Reference(model, x, y, a.global_batch) if condition == "exact" and rank == 0 else None
    step_ms, diffs, samples = [], [], []
    applied_at = None
    for i in range(steps):
        t0 = time.perf_counter()
        with session.step():  # parapilot
            n = int(train_step(iterator))
        step_ms.append((time.perf_counter() - t0) * 1e3)
        samples.append(n)
        if ref is not None:
            diffs.append(ref.step_and_compare(model))
        if condition == "exact":
            if session.applied_plans and applied_at is None:
                applied_at = i
            if applied_at is not None and i >= applied_at + AFTER_PLAN:
                break
            time.sleep(a.step_sleep_ms / 1000.0)
        if session.should_stop:  # parapilot
            break
    result = {"condition": condition, "mode": "agent" if agent else "none",
              "step_ms": step_ms, "final_counts": session.local_counts(),
              "plans": list(session.applied_plans), "samples": samples, "diffs": diffs,
              "telemetry_keys": sorted(session.last_telemetry.collectives)}
    session.close()  # parapilot
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
        self.loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                     dtype="float64")

    def step_and_compare(self, model):
        idx = next(self.order)
        with tf.GradientTape() as tape:
            loss = self.loss_fn(tf.gather(self.y, idx), self.model(tf.gather(self.x, idx)))
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

"""Per-step overhead of parapilot.tensorflow: two copies of the same MultiWorkerMirroredStrategy
job in one launch, stepped in turn (a plain custom loop on an even split of the global batch;
the same loop with a parapilot Session and no agent), so that machine noise hits both alike.
Prints, from worker 0, the median step of each and the difference, then the Session's median
telemetry over --steps more steps of its job alone (compute, wait/dp, wait/other: the boundary
agreement's all-gather; interleaved, its cycle would hold the plain job's step), as JSON.

    python -m parapilot.launch --tf-config --nproc 4 examples/tensorflow_overhead.py
"""

import argparse
import json
import statistics
import time

import numpy as np
import tensorflow as tf

import parapilot.tensorflow
from parapilot import telemetry_keys as keys

FEATURES, CLASSES, SIZE = 64, 10, 16384


def job(strategy):
    with strategy.scope():
        tf.keras.utils.set_random_seed(0)
        model = tf.keras.Sequential([tf.keras.Input((FEATURES,)),
                                     tf.keras.layers.Dense(256, activation="relu"),
                                     tf.keras.layers.Dense(256, activation="relu"),
                                     tf.keras.layers.Dense(CLASSES)])
        return model, tf.keras.optimizers.SGD(0.05)


def train_step_fn(strategy, model, optimizer, scale):
    per_example = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                reduction="none")

    @tf.function
    def train_step(iterator):
        def step_fn(xb, yb):
            with tf.GradientTape() as tape:
                loss = scale(per_example(yb, model(xb, training=True)))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(step_fn, args=next(iterator))
    return train_step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--global-batch", type=int, default=256)
    a = ap.parse_args()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.task_id
    rs = np.random.RandomState(0)
    x = tf.constant(rs.randn(SIZE, FEATURES).astype("float32"))
    y = tf.constant(rs.randint(0, CLASSES, SIZE))
    per_worker = a.global_batch // strategy.num_replicas_in_sync

    # Plain: the strategy's usual input (each worker its own even batch) and loss scale.
    plain_model, plain_opt = job(strategy)
    plain_ds = strategy.distribute_datasets_from_function(
        lambda ctx: tf.data.Dataset.from_tensor_slices((x, y)).shard(
            ctx.num_input_pipelines, ctx.input_pipeline_id).repeat().batch(per_worker))
    plain_it = iter(plain_ds)
    plain_step = train_step_fn(
        strategy, plain_model, plain_opt,
        lambda l: tf.nn.compute_average_loss(l, global_batch_size=a.global_batch))

    model, opt = job(strategy)
    session = parapilot.tensorflow.Session(strategy, model, opt, global_batch=a.global_batch,
                                           agent="", log=lambda level, line: None)
    it = iter(session.distribute_dataset(SIZE, lambda i: (tf.gather(x, i), tf.gather(y, i))))
    step = train_step_fn(strategy, model, opt, session.scale_loss)

    plain_ms, session_ms, telemetry = [], [], []
    for i in range(a.steps):
        t0 = time.perf_counter()
        with session.outside_steps():  # not the session job's time
            plain_step(plain_it)
        t1 = time.perf_counter()
        with session.step():
            step(it)
        t2 = time.perf_counter()
        if i >= a.warmup:
            plain_ms.append((t1 - t0) * 1e3)
            session_ms.append((t2 - t1) * 1e3)
    for i in range(a.steps):
        with session.step():
            step(it)
        t = session.last_telemetry
        cycle = (t.step_end_ns - t.step_start_ns) / 1e6
        telemetry.append((cycle, t.compute_ms, t.collectives[keys.WAIT_DP].ms,
                          t.collectives[keys.WAIT_OTHER].ms))
    session.close()
    if rank == 0:
        med = statistics.median
        out = {"workers": strategy.num_replicas_in_sync, "global_batch": a.global_batch,
               "steps": len(plain_ms), "plain_ms": round(med(plain_ms), 2),
               "session_ms": round(med(session_ms), 2),
               "overhead_ms": round(med(session_ms) - med(plain_ms), 2),
               "alone_cycle_ms": round(med(t[0] for t in telemetry), 2),
               "alone_compute_ms": round(med(t[1] for t in telemetry), 2),
               "alone_wait_dp_ms": round(med(t[2] for t in telemetry), 2),
               "alone_wait_other_ms": round(med(t[3] for t in telemetry), 2),
               "tensorflow": tf.__version__}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

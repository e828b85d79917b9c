"""A TensorFlow MultiWorkerMirroredStrategy training script with parapilot added (the lines marked
"parapilot"; docs/tensorflow.md). Workers are processes named by TF_CONFIG; parapilot's launcher
starts them on one machine with it set:

    python -m parapilot.launch --tf-config --nproc 4 examples/tensorflow_mwms.py --steps 200

With an agent (`parapilot deploy --listen 127.0.0.1:7070 --secret-file secret`):

    PARAPILOT_AGENT=127.0.0.1:7070 PARAPILOT_SECRET_FILE=secret \\
        python -m parapilot.launch --tf-config --nproc 4 examples/tensorflow_mwms.py \\
        --steps 200 --slow-rank 1 --slow-where input

A custom training loop (strategy.run) with Keras 3 by default; --fit trains with model.fit, which
needs tf_keras (TF_USE_LEGACY_KERAS=1: Keras 3's fit fails under this strategy). --slow-rank R
makes worker R slower by --slow-ms per even share of samples, in its step (--slow-where step) or
in its input pipeline (input): a straggler to react to. Without PARAPILOT_AGENT the script
trains on even shares and sends nothing.
"""

import argparse
import logging
import os
import time

import numpy as np
import tensorflow as tf

import parapilot.tensorflow  # parapilot

FEATURES, CLASSES, SIZE = 64, 10, 16384


def slow_op(ms):
    """A graph op that sleeps `ms` milliseconds (a float tensor)."""
    def sleep(v):
        time.sleep(float(v) / 1000.0)
        return np.float32(0)
    return tf.py_function(sleep, [ms], tf.float32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--slow-where", choices=["step", "input"], default="step")
    ap.add_argument("--slow-ms", type=float, default=40.0)
    ap.add_argument("--fit", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("parapilot").setLevel(logging.INFO)  # parapilot: optional

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.task_id
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((FEATURES,)),
                                     tf.keras.layers.Dense(256, activation="relu"),
                                     tf.keras.layers.Dense(256, activation="relu"),
                                     tf.keras.layers.Dense(CLASSES)])
        optimizer = tf.keras.optimizers.SGD(0.05)
    session = parapilot.tensorflow.Session(strategy, model, optimizer,  # parapilot
                                           global_batch=args.global_batch)
    rs = np.random.RandomState(0)  # a learnable task: the class is the largest of 10 features
    features = rs.randn(SIZE, FEATURES).astype("float32")
    x, y = tf.constant(features), tf.constant(features[:, :CLASSES].argmax(1))
    per_sample_ms = args.slow_ms * strategy.num_replicas_in_sync / args.global_batch
    slow = rank == args.slow_rank

    def batch_fn(idx):  # this worker's share of a global batch, by index
        xb = tf.gather(x, idx)
        if slow and args.slow_where == "input":
            with tf.control_dependencies([slow_op(per_sample_ms * tf.cast(tf.size(idx),
                                                                          tf.float32))]):
                xb = tf.identity(xb)
        return xb, tf.gather(y, idx)

    dataset = session.distribute_dataset(SIZE, batch_fn)  # parapilot
    per_example = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                reduction="none")

    def forward(xb):
        if slow and args.slow_where == "step":
            n = tf.cast(tf.shape(xb)[0], tf.float32)
            with tf.control_dependencies([slow_op(per_sample_ms * n)]):
                xb = tf.identity(xb)
        return model(xb, training=True)

    if args.fit:
        with strategy.scope():
            inputs = tf.keras.Input((FEATURES,))
            fit_model = tf.keras.Model(inputs, tf.keras.layers.Lambda(forward)(inputs))
            fit_model.compile(optimizer=optimizer,
                              loss=session.keras_loss(per_example))  # parapilot
        fit_model.fit(dataset, steps_per_epoch=args.steps, epochs=1, verbose=0,
                      callbacks=[session.keras_callback()])  # parapilot
    else:
        iterator = iter(dataset)

        @tf.function
        def train_step(iterator):
            def step_fn(xb, yb):
                with tf.GradientTape() as tape:
                    loss = session.scale_loss(per_example(yb, forward(xb)))  # parapilot
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
                return loss
            return strategy.reduce("SUM", strategy.run(step_fn, args=next(iterator)), None)

        for step in range(args.steps):
            with session.step():  # parapilot
                loss = train_step(iterator)
            if rank == 0 and step % 50 == 0:
                print(f"step {step}: loss {float(loss):.4f}", flush=True)
            if session.should_stop:  # parapilot
                break
    session.close()  # parapilot


if __name__ == "__main__":
    main()

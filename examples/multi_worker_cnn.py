"""Tutorial-style Keras 3 multi-worker training with tfdist (CNN, SGD, tf.data global batch, BackupAndRestore).

Run two workers on this machine:

    tfdist-launch -n 2 -- python examples/multi_worker_cnn.py --out=/tmp/cnn

or start each process yourself with its own TF_CONFIG (see the README). Every worker writes its final
weights to OUT/weights-<rank>.npz; they are identical.
"""

import argparse
import os

import numpy as np

import tfdist

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True, help="directory for backups and final weights")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--global_batch", type=int, default=32)
parser.add_argument("--num_examples", type=int, default=200)
args = parser.parse_args()

# First thing: the strategy (it starts TensorFlow's multi-worker runtime).
strategy = tfdist.MultiWorkerStrategy(timeout=120)
rank = strategy.cluster.rank if strategy.cluster else 0

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

rng = np.random.default_rng(0)
images = rng.random((args.num_examples, 12, 12, 1), dtype=np.float32)
labels = (images.mean(axis=(1, 2, 3)) > 0.5).astype("int32")
# The tf.data pipeline is batched by the GLOBAL batch; the strategy splits each batch over workers.
train = tf.data.Dataset.from_tensor_slices((images, labels)).batch(args.global_batch)

keras.utils.set_random_seed(1)
with strategy.scope():
    model = keras.Sequential(
        [
            keras.Input((12, 12, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )

# Keras' BackupAndRestore: a directory per worker, or one shared by all (tfdist has only the chief write it).
backup = keras.callbacks.BackupAndRestore(os.path.join(args.out, f"backup-{rank}"))
model.fit(train, epochs=args.epochs, callbacks=[backup], verbose=2 if rank == 0 else 0)
np.savez(os.path.join(args.out, f"weights-{rank}.npz"), *model.get_weights())
print(f"worker {rank} done")

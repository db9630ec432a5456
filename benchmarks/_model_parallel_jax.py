"""The JAX side of benchmarks/model_parallel.py: Keras 3's own ModelParallel on the JAX backend.

Run by `python -m benchmarks.model_parallel --jax_python PATH` in an environment with `jax` and
the same Keras (see the docstring there), with the repository on PYTHONPATH. It builds and
compiles the model, prints `@json {"ready": true}`, then answers one request per line of its
standard input:

* `round`: one `fit` epoch over the same batches as the TensorFlow side, timed inside `fit` with
  `benchmarks._timing` (the median of the intervals between batch ends after the warm-up steps);
  prints `@json {"step_time": seconds, "loss": the epoch's loss}`;
* `finish`: prints `@json {"bytes_device0": ..., "specs": {variable path: spec}}` (the sharding
  specs are checked there against tfdist's placement) and exits.

Between requests it waits, idle, so that model_parallel.py can interleave its rounds with the
TensorFlow ones without the two competing for the cores.

    PYTHONPATH=. python benchmarks/_model_parallel_jax.py '{"mesh": {"batch": 2, "model": 4}, ...}'
"""

import json
import math
import os
import re
import sys

CONFIG = json.loads(sys.argv[1])
MESH = CONFIG["mesh"]
os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={math.prod(MESH.values())}"

import keras  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import _timing  # noqa: E402  (the standard library and Keras only)
from tfdist import models  # noqa: E402  (plain Keras; does not load TensorFlow)

# tfdist.layouts.transformer() written as a Keras LayoutMap (rank-2 kernels for the MLP and head).
M = "model" if "model" in MESH else None
LAYOUT = {
    r"(^|/)((mlp|ffn|ffw|feed_forward)[^/]*_(in|up|gate))/kernel$": (None, M),
    r"(^|/)((mlp|ffn|ffw|feed_forward)[^/]*_(in|up|gate))/bias$": (M,),
    r"(^|/)((mlp|ffn|ffw|feed_forward)[^/]*_(out|down))/kernel$": (M, None),
    r"(^|/)([^/]*)/(query|key|value)/kernel$": (None, M, None),
    r"(^|/)([^/]*)/(query|key|value)/bias$": (M, None),
    r"(^|/)([^/]*)/attention_output/kernel$": (M, None, None),
    r"(^|/)((?!pos)[^/]*embedding[^/]*)/embeddings$": (M, None),
    r"(^|/)(logits|lm_head)/kernel$": (None, M),
    r"(^|/)(logits|lm_head)/bias$": (M,),
}


def main():
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh(shape=tuple(MESH.values()), axis_names=list(MESH), devices=devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    for pattern, spec in LAYOUT.items():
        layout_map[".*" + pattern] = spec  # LayoutMap full-matches; tfdist searches
    batch_axis = "batch" if "batch" in MESH else None
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name=batch_axis)
    )
    keras.utils.set_random_seed(0)
    model = models.transformer_lm(
        seq_len=CONFIG["seq_len"],
        vocab_size=CONFIG["vocab_size"],
        d_model=CONFIG["d_model"],
        num_heads=CONFIG["num_heads"],
        num_layers=CONFIG["num_layers"],
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(0)
    batch, steps, warmup = CONFIG["global_batch_size"], CONFIG["steps"], CONFIG["warmup"]
    n = batch * (warmup + steps)  # the TensorFlow side's data: the same generator, the same draws
    x = rng.integers(0, CONFIG["vocab_size"], (n, CONFIG["seq_len"])).astype("int32")
    y = rng.integers(0, CONFIG["vocab_size"], (n, CONFIG["seq_len"])).astype("int32")
    model.fit(x[:batch], y[:batch], batch_size=batch, verbose=0)  # compile and build the optimizer
    reply({"ready": True})
    for request in sys.stdin:
        if request.strip() != "round":
            break
        losses = LastLoss()
        step = _timing.step_time(model, x, y, steps=steps, warmup=warmup, batch_size=batch, callbacks=[losses])
        reply({"step_time": step, "loss": losses.loss})
    variables = list(model.weights) + list(model.optimizer.variables)
    specs = {}
    for v in variables:
        spec = tuple(v.value.sharding.spec) if hasattr(v.value.sharding, "spec") else ()
        spec = spec + (None,) * (len(v.shape) - len(spec))
        specs[re.sub(r"^adam(_\d+)?/", "adam/", v.path)] = list(spec)
    device0 = sum(v.value.addressable_shards[0].data.nbytes for v in variables)
    reply({"bytes_device0": device0, "specs": specs})


def reply(obj):
    print("@json " + json.dumps(obj), flush=True)


class LastLoss(keras.callbacks.Callback):
    loss = None

    def on_epoch_end(self, epoch, logs=None):
        self.loss = float(logs["loss"])


if __name__ == "__main__":
    main()

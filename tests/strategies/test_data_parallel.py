"""DataParallelStrategy: Keras 3 fit under it equals single-device training.

Every comparison trains the same model (same seed, same data order, same global batch) once
without a strategy and once under DataParallelStrategy on 4 logical CPUs, then compares
weights and per-epoch losses. Tolerances: SGD weights atol 1e-5, Adam weights atol 1e-4,
losses rtol 1e-5 (float32 sums over replicas associate differently than on one device).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist

DEVICES = [f"CPU:{i}" for i in range(4)]
SGD_ATOL = 1e-5
ADAM_ATOL = 1e-4
LOSS_RTOL = 1e-5


def cnn(optimizer, *, regularized=False):
    keras.utils.set_random_seed(7)
    reg = keras.regularizers.L2(1e-3) if regularized else None
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, activation="relu", kernel_regularizer=reg),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )
    model.compile(
        optimizer=optimizer(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 3, size=(n,)).astype("int32")
    return x, y


# One-device reference runs, shared by the tests that train the same model on the same data the same way.
_REFERENCES = {}


def reference(name, optimizer, x, y, *, regularized=False, **fit_kwargs):
    """The one-device model `cnn(optimizer)` trained on (x, y), and its history; trained once per module.

    `name` stands for `optimizer` (which may be a lambda); the key holds every other input as well.
    """
    fit_kwargs = {"epochs": 2, "shuffle": False, "verbose": 0, **fit_kwargs}
    key = (name, regularized, x.tobytes(), y.tobytes(), tuple(sorted(fit_kwargs.items())))
    if key not in _REFERENCES:
        ref = cnn(optimizer, regularized=regularized)
        _REFERENCES[key] = ref, ref.fit(x, y, **fit_kwargs).history
    return _REFERENCES[key]


def train_dist(optimizer, x, y, *, strategy=None, regularized=False, **fit_kwargs):
    fit_kwargs = {"epochs": 2, "shuffle": False, "verbose": 0, **fit_kwargs}
    strategy = strategy or tfdist.DataParallelStrategy(devices=DEVICES)
    with strategy.scope():
        dist = cnn(optimizer, regularized=regularized)
    return dist, dist.fit(x, y, **fit_kwargs).history


def train_both(name, optimizer, x, y, *, strategy=None, regularized=False, **fit_kwargs):
    """The shared one-device reference (see `reference`) and a fresh run under `strategy`."""
    ref, ref_hist = reference(name, optimizer, x, y, regularized=regularized, **fit_kwargs)
    dist, dist_hist = train_dist(optimizer, x, y, strategy=strategy, regularized=regularized, **fit_kwargs)
    return ref, ref_hist, dist, dist_hist


def assert_weights_close(ref, dist, atol):
    for w_ref, w_dist, v in zip(ref.get_weights(), dist.get_weights(), ref.weights):
        np.testing.assert_allclose(w_dist, w_ref, atol=atol, rtol=0, err_msg=v.path)


def sgd():
    return keras.optimizers.SGD(0.1)


@pytest.mark.parametrize(
    "n,batch_size",
    [
        (64, 16),  # even: 4 examples per replica
        (42, 16),  # uneven last batch: 10 examples over 4 replicas
        (10, 16),  # uneven FIRST (and only) batch: crashes plain MirroredStrategy
        (34, 16),  # last batch of 2: two replicas get no example at all
    ],
)
def test_fit_matches_single_device(n, batch_size):
    assert_fit_matches_single_device(n, batch_size)


def assert_fit_matches_single_device(n, batch_size, strategy=None):
    x, y = data(n)
    ref, ref_hist, dist, dist_hist = train_both("sgd", sgd, x, y, batch_size=batch_size, strategy=strategy)
    assert_weights_close(ref, dist, SGD_ATOL)
    np.testing.assert_allclose(dist_hist["loss"], ref_hist["loss"], rtol=LOSS_RTOL)
    np.testing.assert_allclose(dist_hist["accuracy"], ref_hist["accuracy"], rtol=LOSS_RTOL)
    # Training moved the weights well beyond the tolerance, so a match is informative.
    assert max(np.abs(a - b).max() for a, b in zip(ref.get_weights(), cnn(sgd).get_weights())) > 100 * SGD_ATOL


def test_fit_with_tf_data_regularizer_and_sample_weight():
    x, y = data(42)
    sw = np.linspace(0.5, 2.0, len(y)).astype("float32")

    def fit(model):
        ds = tf.data.Dataset.from_tensor_slices((x, y, sw)).batch(16)
        return model.fit(ds, epochs=2, verbose=0, shuffle=False).history

    ref = cnn(sgd, regularized=True)
    ref_hist = fit(ref)
    with tfdist.DataParallelStrategy(devices=DEVICES).scope():
        dist = cnn(sgd, regularized=True)
    dist_hist = fit(dist)
    assert_weights_close(ref, dist, SGD_ATOL)
    np.testing.assert_allclose(dist_hist["loss"], ref_hist["loss"], rtol=LOSS_RTOL)


def test_adam_matches_single_device():
    x, y = data(42)
    ref, ref_hist, dist, dist_hist = train_both("adam", lambda: keras.optimizers.Adam(1e-2), x, y, batch_size=16)
    assert_weights_close(ref, dist, ADAM_ATOL)
    np.testing.assert_allclose(dist_hist["loss"], ref_hist["loss"], rtol=1e-4)


@pytest.mark.parametrize(
    "clip",
    [{"clipnorm": 0.05}, {"global_clipnorm": 0.05}, {"clipvalue": 0.002}],
    ids=lambda c: next(iter(c)),
)
def test_clipping_acts_on_the_all_reduced_gradient(clip):
    x, y = data(42)
    ref, ref_hist, dist, dist_hist = train_both(
        ("sgd0.5", tuple(clip.items())), lambda: keras.optimizers.SGD(0.5, **clip), x, y, batch_size=16
    )
    assert_weights_close(ref, dist, SGD_ATOL)
    np.testing.assert_allclose(dist_hist["loss"], ref_hist["loss"], rtol=LOSS_RTOL)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("replicas", [4, 1])  # 1: Keras' accumulation cond would call merge_call
def test_gradient_accumulation_matches_single_device(optimizer, replicas):
    def make():
        if optimizer == "sgd":
            return keras.optimizers.SGD(0.1, gradient_accumulation_steps=3)
        return keras.optimizers.Adam(1e-2, gradient_accumulation_steps=3, global_clipnorm=1.0)

    x, y = data(42)
    strategy = tfdist.DataParallelStrategy(devices=DEVICES[:replicas])
    ref, ref_hist, dist, dist_hist = train_both(("accumulate", optimizer), make, x, y, strategy=strategy, batch_size=8)
    assert_weights_close(ref, dist, SGD_ATOL if optimizer == "sgd" else ADAM_ATOL)
    np.testing.assert_allclose(dist_hist["loss"], ref_hist["loss"], rtol=1e-4)
    micro_steps = 2 * -(-42 // 8)  # 2 epochs of 6 batches (the last one of 2 examples)
    assert int(dist.optimizer.iterations.numpy()) == int(ref.optimizer.iterations.numpy()) == micro_steps // 3


@pytest.mark.parametrize("n", [42, 34])  # 34: the last batch of 2 leaves two replicas empty
def test_evaluate_and_predict_match_single_device(n):
    x, y = data(n)
    ref, _, dist, _ = train_both("sgd", sgd, x, y, batch_size=16, epochs=1)
    ref_eval = ref.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    dist_eval = dist.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(dist_eval[key], ref_eval[key], rtol=LOSS_RTOL)
    np.testing.assert_allclose(
        dist.predict(x, batch_size=16, verbose=0), ref.predict(x, batch_size=16, verbose=0), atol=1e-5
    )


@pytest.mark.parametrize("communication", ["ring", "reduce_to_one", "hierarchical"])
def test_every_communication_matches_single_device(communication):
    x, y = data(42)
    strategy = tfdist.DataParallelStrategy(devices=DEVICES, communication=communication)
    assert strategy.resolved_communication == communication
    ref, _, dist, _ = train_both("sgd", sgd, x, y, batch_size=16, strategy=strategy)
    assert_weights_close(ref, dist, SGD_ATOL)


@pytest.mark.parametrize("gradient_dtype,atol", [("bfloat16", 5e-3), ("float16", 2e-4)])
def test_compressed_all_reduce_stays_close_to_float32(gradient_dtype, atol):
    """Gradients all-reduced in 16 bits: weights within `atol` of the float32 all-reduce after 6 SGD steps."""
    x, y = data(48)
    exact = tfdist.DataParallelStrategy(devices=DEVICES)
    narrow = tfdist.DataParallelStrategy(devices=DEVICES, gradient_dtype=gradient_dtype)
    assert f"gradient_dtype={gradient_dtype!r}" in repr(narrow)
    if "float32_all_reduce" not in _REFERENCES:  # shared by both cases
        _REFERENCES["float32_all_reduce"] = train_dist(sgd, x, y, batch_size=16, strategy=exact)[0]
    ref = _REFERENCES["float32_all_reduce"]
    dist, _ = train_dist(sgd, x, y, batch_size=16, strategy=narrow)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(ref.get_weights(), dist.get_weights()))
    assert 0 < diff < atol, diff  # rounded on the wire (not exact), but close


def test_model_checkpoint_and_keras_save_load(tmp_path):
    x, y = data(42)
    strategy = tfdist.DataParallelStrategy(devices=DEVICES)
    with strategy.scope():
        model = cnn(sgd)
    best = tmp_path / "best.keras"
    model.fit(
        x,
        y,
        batch_size=16,
        epochs=2,
        verbose=0,
        callbacks=[keras.callbacks.ModelCheckpoint(best, monitor="loss", save_best_only=True)],
    )
    assert best.is_file()
    expected = model.predict(x, verbose=0)
    model.save(tmp_path / "final.keras")

    restored = keras.models.load_model(tmp_path / "final.keras")  # one device, no strategy
    np.testing.assert_allclose(restored.predict(x, verbose=0), expected, atol=1e-6)
    with strategy.scope():
        resumed = keras.models.load_model(tmp_path / "final.keras")
    np.testing.assert_allclose(resumed.predict(x, verbose=0), expected, atol=1e-6)
    resumed.fit(x, y, batch_size=16, epochs=1, verbose=0)  # optimizer state came back; training goes on
    assert keras.models.load_model(best).count_params() == model.count_params()


def test_strategy_is_a_mirrored_strategy_with_defaults():
    strategy = tfdist.DataParallelStrategy()
    assert isinstance(strategy, tf.distribute.MirroredStrategy)
    assert strategy.num_replicas_in_sync == 8
    assert strategy.communication == "auto"
    assert strategy.resolved_communication == "reduce_to_one"  # what "auto" is on CPUs
    assert isinstance(strategy.extended._cross_device_ops, tf.distribute.ReductionToOneDevice)
    assert "communication='auto'" in repr(strategy)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"communication": "fast"},
            r"communication='fast'.*\('auto', 'ring', 'reduce_to_one', 'hierarchical', 'nccl'\)",
        ),
        ({"communication": "nccl", "devices": DEVICES}, r"'nccl' needs GPU devices.*CPU:0.*'reduce_to_one'"),
        ({"devices": ["CPU:0", "CPU:42"]}, r"'CPU:42' does not exist.*Available logical devices"),
        ({"devices": ["CPU:1", "/cpu:1"]}, r"repeated: \['/device:CPU:1'\]"),
        ({"devices": []}, r"Received: devices=\[\]"),
        ({"devices": "CPU:0"}, r"Received: devices='CPU:0'"),
        ({"gradient_dtype": "float8"}, r"gradient_dtype='float8'.*\(None, 'bfloat16', 'float16'\)"),
    ],
)
def test_bad_arguments_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tfdist.DataParallelStrategy(**kwargs)


def test_constructor_is_keyword_only():
    with pytest.raises(TypeError):
        tfdist.DataParallelStrategy(DEVICES)


def test_custom_training_loop_matches_single_device():
    """strategy.run with a Keras loss and optimizer.apply: each replica weighted by its examples."""
    x, y = data(42)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def train(model, strategy=None):
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)

        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            model.optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

        if strategy is None:
            for xb, yb in dataset:
                tf.function(step)(xb, yb)
            return
        run = tf.function(lambda xb, yb: strategy.run(step, args=(xb, yb)))
        for xb, yb in strategy.experimental_distribute_dataset(dataset):
            run(xb, yb)

    ref = cnn(sgd)
    train(ref)
    strategy = tfdist.DataParallelStrategy(devices=DEVICES)
    with strategy.scope():
        dist = cnn(sgd)
    train(dist, strategy)
    assert_weights_close(ref, dist, SGD_ATOL)


# Eagerly on 2 replicas: MirroredStrategy runs each replica's eager ops in a thread of its own, passing control
# from thread to thread, and beside busy processes each hand-off waits for the scheduler (measured on 4 replicas:
# 8 s alone, 33 s beside two busy processes, 154 s once in the suite, where the graph-mode case took 11 s); 33
# examples leave the second replica's share of the last batch (1 example) empty, as 4 replicas leave three empty.
@pytest.mark.parametrize("compile_kwargs, replicas", [({"steps_per_execution": 3}, 4), ({"run_eagerly": True}, 2)],
                         ids=["{'steps_per_execution': 3}", "{'run_eagerly': True}"])
def test_fit_modes_match_single_device(compile_kwargs, replicas):
    x, y = data(33)

    def make():
        model = cnn(sgd)
        model.compile(
            optimizer=sgd(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            **compile_kwargs,
        )
        return model

    fit = {"batch_size": 16, "epochs": 2, "shuffle": False, "verbose": 0, "validation_data": (x[:10], y[:10])}
    ref = make()
    ref_hist = ref.fit(x, y, **fit).history
    with tfdist.DataParallelStrategy(devices=DEVICES[:replicas]).scope():
        dist = make()
    dist_hist = dist.fit(x, y, **fit).history
    assert_weights_close(ref, dist, SGD_ATOL)
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        np.testing.assert_allclose(dist_hist[key], ref_hist[key], rtol=LOSS_RTOL, err_msg=key)


def test_reshuffling_dataset_trains_on_the_same_order_as_one_device():
    """A `shuffle()`d dataset reshuffles on every pass; building the model must not start a pass."""
    assert_reshuffling_dataset_trains_on_the_same_order(tfdist.DataParallelStrategy(devices=DEVICES))


class UserDataParallelStrategy(tfdist.DataParallelStrategy):
    """A user's subclass, defined outside tfdist (in this test module): it keeps every fix."""

    def __repr__(self):
        return "UserDataParallelStrategy()"


def test_a_users_subclass_keeps_the_uneven_first_batch_fix():
    # 10 examples in a batch of 16 over 4 replicas: the first batch splits unevenly (plain MirroredStrategy crashes).
    assert_fit_matches_single_device(10, 16, strategy=UserDataParallelStrategy(devices=DEVICES))


def test_a_users_subclass_keeps_the_reshuffle_order():
    assert_reshuffling_dataset_trains_on_the_same_order(UserDataParallelStrategy(devices=DEVICES))


def assert_reshuffling_dataset_trains_on_the_same_order(strategy):
    x, y = data(64)

    def dataset():
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64, seed=5).batch(16)

    if "reshuffling" not in _REFERENCES:  # one device, shared by the two tests that call this
        ref = cnn(sgd)
        ref.fit(dataset(), epochs=2, verbose=0)
        _REFERENCES["reshuffling"] = ref
    ref = _REFERENCES["reshuffling"]
    with strategy.scope():
        dist = cnn(sgd)
    dist.fit(dataset(), epochs=2, verbose=0)
    assert_weights_close(ref, dist, SGD_ATOL)

"""tfdist.models.transformer_lm: shapes, causality, weight paths, saving, argument checks."""

import keras
import numpy as np
import pytest

from tfdist import models


@pytest.fixture(scope="module")
def lm():
    keras.utils.set_random_seed(0)
    return models.transformer_lm(seq_len=12, d_model=32, num_heads=4, num_layers=2)


def test_logits_shape(lm):
    tokens = np.random.default_rng(0).integers(0, 256, (3, 12), dtype=np.int32)
    logits = lm(tokens)
    assert tuple(logits.shape) == (3, 12, 256)
    assert logits.dtype == "float32"


def test_is_causal(lm):
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 256, (2, 12), dtype=np.int32)
    changed = tokens.copy()
    changed[:, 7] = (changed[:, 7] + 1) % 256
    before, after = np.asarray(lm(tokens)), np.asarray(lm(changed))
    np.testing.assert_allclose(after[:, :7], before[:, :7], atol=1e-6)  # earlier positions: untouched
    assert np.abs(after[:, 7:] - before[:, 7:]).max(axis=-1).min() > 1e-4  # later ones: all changed


def test_weight_paths_read_as_layer_paths(lm):
    paths = {w.path: tuple(w.shape) for w in lm.weights}
    assert paths["token_embedding/embeddings"] == (256, 32)
    assert paths["position_embedding/embeddings"] == (12, 32)
    assert paths["block_0/attention/query/kernel"] == (32, 4, 8)
    assert paths["block_1/attention/attention_output/kernel"] == (4, 8, 32)
    assert paths["block_1/mlp_in/kernel"] == (32, 128)  # mlp_dim defaults to 4 * d_model
    assert paths["block_1/mlp_out/kernel"] == (128, 32)
    assert paths["logits/kernel"] == (32, 256)
    assert not [p for p in paths if p.startswith("block_2/")]


def test_keras_file_round_trip(lm, tmp_path):
    tokens = np.arange(24, dtype=np.int32).reshape(2, 12)
    path = str(tmp_path / "lm.keras")
    lm.save(path)
    restored = keras.saving.load_model(path)
    np.testing.assert_allclose(np.asarray(restored(tokens)), np.asarray(lm(tokens)), atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(seq_len=0), r"`seq_len`.*Received: seq_len=0"),
        (dict(seq_len=8, d_model=30, num_heads=4), r"`num_heads` must divide `d_model`.*d_model=30, num_heads=4"),
        (dict(seq_len=8, num_layers=0), r"`num_layers`.*Received: num_layers=0"),
        (dict(seq_len=8, mlp_dim=-1), r"`mlp_dim`.*Received: mlp_dim=-1"),
        (dict(seq_len=8, vocab_size=2.5), r"`vocab_size`.*positive integer"),
        (dict(seq_len=8, dropout=1.0), r"`dropout`.*Received: dropout=1.0.*\[0, 1\)"),
    ],
)
def test_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        models.transformer_lm(**kwargs)


def test_arguments_are_keyword_only():
    with pytest.raises(TypeError):
        models.transformer_lm(8)

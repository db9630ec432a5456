"""Reference models that tfdist trains, tests and benchmarks.

`transformer_lm` is a byte-level, causal, decoder-only transformer language
model in plain Keras 3. Its weights have readable paths that placement rules
can match, for example::

    token_embedding/embeddings
    position_embedding/embeddings
    block_0/attention_norm/gamma
    block_0/attention/query/kernel        (d_model, num_heads, head_dim)
    block_0/attention/attention_output/kernel
    block_0/mlp_norm/gamma
    block_0/mlp_in/kernel                 (d_model, mlp_dim)
    block_0/mlp_out/kernel                (mlp_dim, d_model)
    final_norm/gamma
    logits/kernel                         (d_model, vocab_size)
"""

from __future__ import annotations

import keras
from keras import ops

from tfdist import _validate

_INIT_STDDEV = 0.02


def _check_positive_int(name: str, value) -> None:
    _validate.integer(name, value, where=" of transformer_lm()")


@keras.saving.register_keras_serializable(package="tfdist")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding of each position to a `(batch, length, dim)` input.

    Args:
        max_length: the longest sequence the layer accepts.
        **kwargs: base `keras.layers.Layer` arguments (`name`, `dtype`, ...).

    Example:

    >>> import numpy as np
    >>> tuple(PositionEmbedding(max_length=8)(np.zeros((2, 5, 3), "float32")).shape)
    (2, 5, 3)
    """

    def __init__(self, *, max_length: int, **kwargs):
        super().__init__(**kwargs)
        self.max_length = max_length

    def build(self, input_shape):
        self.embeddings = self.add_weight(
            name="embeddings",
            shape=(self.max_length, input_shape[-1]),
            initializer=keras.initializers.RandomNormal(stddev=_INIT_STDDEV),
        )

    def call(self, inputs):
        length = ops.shape(inputs)[1]
        return inputs + ops.expand_dims(self.embeddings[:length], 0)

    def get_config(self):
        return {**super().get_config(), "max_length": self.max_length}


@keras.saving.register_keras_serializable(package="tfdist")
class TransformerBlock(keras.layers.Layer):
    """A pre-LayerNorm decoder block: causal self-attention, then a GELU MLP, each residual.

    Args:
        d_model: width of the residual stream.
        num_heads: attention heads; must divide `d_model`.
        mlp_dim: hidden width of the MLP.
        dropout: dropout rate after attention and after the MLP.
        **kwargs: base `keras.layers.Layer` arguments (`name`, `dtype`, ...).

    Example:

    >>> import numpy as np
    >>> block = TransformerBlock(d_model=8, num_heads=2, mlp_dim=16)
    >>> tuple(block(np.zeros((1, 4, 8), "float32")).shape)
    (1, 4, 8)
    """

    def __init__(self, *, d_model: int, num_heads: int, mlp_dim: int, dropout: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.d_model = d_model
        self.num_heads = num_heads
        self.mlp_dim = mlp_dim
        self.dropout = dropout
        init = keras.initializers.RandomNormal(stddev=_INIT_STDDEV)
        self.attention_norm = keras.layers.LayerNormalization(epsilon=1e-5, name="attention_norm")
        self.attention = keras.layers.MultiHeadAttention(
            num_heads=num_heads,
            key_dim=d_model // num_heads,
            kernel_initializer=init,
            name="attention",
        )
        self.attention_dropout = keras.layers.Dropout(dropout, name="attention_dropout")
        self.mlp_norm = keras.layers.LayerNormalization(epsilon=1e-5, name="mlp_norm")
        self.mlp_in = keras.layers.Dense(mlp_dim, activation="gelu", kernel_initializer=init, name="mlp_in")
        self.mlp_out = keras.layers.Dense(d_model, kernel_initializer=init, name="mlp_out")
        self.mlp_dropout = keras.layers.Dropout(dropout, name="mlp_dropout")

    def build(self, input_shape):
        # Build the sublayers here, inside this block's name scope, so that every weight
        # is created with its full path (block_0/attention/query/kernel, ...).
        self.attention_norm.build(input_shape)
        self.attention.build(input_shape, input_shape)
        self.mlp_norm.build(input_shape)
        self.mlp_in.build(input_shape)
        self.mlp_out.build((*input_shape[:-1], self.mlp_dim))

    def call(self, inputs, training=None):
        x = self.attention_norm(inputs)
        x = self.attention(x, x, use_causal_mask=True, training=training)
        inputs = inputs + self.attention_dropout(x, training=training)
        x = self.mlp_out(self.mlp_in(self.mlp_norm(inputs)))
        return inputs + self.mlp_dropout(x, training=training)

    def get_config(self):
        return {
            **super().get_config(),
            "d_model": self.d_model,
            "num_heads": self.num_heads,
            "mlp_dim": self.mlp_dim,
            "dropout": self.dropout,
        }


def transformer_lm_parameters(
    *, seq_len: int, vocab_size: int = 256, d_model: int = 128, num_layers: int = 2, mlp_dim: int | None = None
) -> int:
    """The number of weights `transformer_lm` makes with these sizes, computed without building it.

    `num_heads` does not change it (the heads split `d_model`).

    Example:

    >>> transformer_lm_parameters(seq_len=16, d_model=32, num_layers=1) == transformer_lm(
    ...     seq_len=16, d_model=32, num_heads=2, num_layers=1).count_params()
    True
    """
    mlp_dim = 4 * d_model if mlp_dim is None else mlp_dim
    attention = 4 * (d_model * d_model + d_model)  # query, key, value, output: kernel and bias each
    mlp = 2 * d_model * mlp_dim + mlp_dim + d_model
    block = 2 * 2 * d_model + attention + mlp  # two LayerNorms (gamma, beta)
    embeddings = (vocab_size + seq_len) * d_model
    return embeddings + num_layers * block + 2 * d_model + d_model * vocab_size + vocab_size


def transformer_lm(
    *,
    seq_len: int,
    vocab_size: int = 256,
    d_model: int = 128,
    num_heads: int = 4,
    num_layers: int = 2,
    mlp_dim: int | None = None,
    dropout: float = 0.0,
) -> keras.Model:
    """Builds a causal decoder-only transformer language model over bytes.

    Token embedding plus learned position embedding, `num_layers` pre-LayerNorm
    blocks (causal multi-head self-attention and a GELU MLP), a final
    LayerNorm and a dense head. The model maps int token ids of shape
    `(batch, seq_len)` to next-token logits of shape `(batch, seq_len,
    vocab_size)`; position `t` sees only positions `<= t`. Compile it with
    `SparseCategoricalCrossentropy(from_logits=True)`.

    Args:
        seq_len: number of tokens per example (the context length).
        vocab_size: number of token ids; 256 for bytes.
        d_model: width of the residual stream.
        num_heads: attention heads; must divide `d_model`.
        num_layers: number of transformer blocks.
        mlp_dim: hidden width of each MLP; defaults to `4 * d_model`.
        dropout: dropout rate in `[0, 1)`.

    Returns:
        An uncompiled `keras.Model` named "transformer_lm".

    Raises:
        ValueError: if a size is not a positive integer, `num_heads` does not
            divide `d_model`, or `dropout` is outside `[0, 1)`.

    Example:

    >>> model = transformer_lm(seq_len=16, d_model=32, num_heads=2, num_layers=1)
    >>> model.output_shape
    (None, 16, 256)
    """
    for name, value in [
        ("seq_len", seq_len),
        ("vocab_size", vocab_size),
        ("d_model", d_model),
        ("num_heads", num_heads),
        ("num_layers", num_layers),
    ]:
        _check_positive_int(name, value)
    if mlp_dim is None:
        mlp_dim = 4 * d_model
    _check_positive_int("mlp_dim", mlp_dim)
    if d_model % num_heads:
        raise ValueError(
            f"`num_heads` must divide `d_model` in transformer_lm(). Received: d_model={d_model}, "
            f"num_heads={num_heads}. Choose num_heads among the divisors of d_model."
        )
    if not _validate.is_number(dropout) or not 0 <= dropout < 1:
        raise _validate.invalid("dropout", dropout, "a number in [0, 1)", where=" of transformer_lm()")

    init = keras.initializers.RandomNormal(stddev=_INIT_STDDEV)
    tokens = keras.Input(shape=(seq_len,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(vocab_size, d_model, embeddings_initializer=init, name="token_embedding")(tokens)
    x = PositionEmbedding(max_length=seq_len, name="position_embedding")(x)
    x = keras.layers.Dropout(dropout, name="embedding_dropout")(x)
    for i in range(num_layers):
        x = TransformerBlock(d_model=d_model, num_heads=num_heads, mlp_dim=mlp_dim, dropout=dropout, name=f"block_{i}")(
            x
        )
    x = keras.layers.LayerNormalization(epsilon=1e-5, name="final_norm")(x)
    logits = keras.layers.Dense(vocab_size, kernel_initializer=init, name="logits")(x)
    return keras.Model(tokens, logits, name="transformer_lm")

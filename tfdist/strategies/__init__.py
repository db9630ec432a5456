"""tf.distribute strategies built by tfdist (import them from `tfdist`)."""

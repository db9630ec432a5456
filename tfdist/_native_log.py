"""Hiding TensorFlow's native start-up logs in binaries that own their process."""

import contextlib
import os
import sys
import tempfile


@contextlib.contextmanager
def native_stderr_silenced():
    """Hides what is written to file descriptor 2 meanwhile, and replays it if the block raises.

    TensorFlow's native code logs to stderr before its log level applies (oneDNN and CUDA
    notices on import, a cuInit error on machines without a GPU driver); those lines are noise
    to a user of a binary. Only binaries, which own their process, may redirect the descriptor.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        except BaseException:
            sys.stderr.flush()
            os.dup2(saved, 2)
            captured.seek(0)
            os.write(2, captured.read())
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)

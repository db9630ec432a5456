"""The byte-level corpus the reference language model trains on.

By default the corpus is the Python standard library's own source code: it is
on every machine that runs tfdist, so examples and tests need no download. Any
text file or directory of text files works too.
"""

from __future__ import annotations

import codecs
import math
import os
import stat
import sysconfig
from typing import TYPE_CHECKING

import numpy as np

from tfdist import _validate

if TYPE_CHECKING:
    import tensorflow as tf

DEFAULT_MAX_BYTES = 4_000_000
"""`load_corpus` reads at most this many bytes unless told otherwise."""

_SKIPPED_STDLIB_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_SEPARATOR = b"\n"
_READ_CHUNK = 1 << 20


def _walk_sorted(root: str, skip_dir) -> list[str]:
    """All files under `root` in sorted, platform-independent order, pruning dirs where skip_dir(name)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not skip_dir(d))
        found.extend(os.path.join(dirpath, f) for f in sorted(filenames))
    return found


def stdlib_corpus_files() -> list[str]:
    """Lists the `.py` source files of the running Python's standard library.

    Files come in a deterministic (sorted) order; `site-packages` and the
    standard library's test suites are left out.

    Returns:
        Absolute paths of the `.py` files.

    Raises:
        ValueError: if the standard library directory holds no `.py` files
            (e.g. a Python distribution that ships only bytecode).

    Example:

    >>> files = stdlib_corpus_files()
    >>> any(f.endswith("os.py") for f in files)
    True
    """
    root = sysconfig.get_paths()["stdlib"]
    files = [
        f for f in _walk_sorted(root, lambda d: d in _SKIPPED_STDLIB_DIRS or d.startswith(".")) if f.endswith(".py")
    ]
    if not files:
        raise ValueError(
            f"The Python standard library at {root!r} holds no .py source files, so the default "
            "corpus is unavailable. Pass a text file or a directory of text files as the corpus."
        )
    return files


_FILE_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    """What a `st_mode` that is neither a regular file nor a directory is, in words."""
    return next((name for is_kind, name in _FILE_KINDS if is_kind(mode)), "not a regular file")


def _is_regular_file(path: str) -> bool:
    """True for a regular file (or a link to one); never opens `path`, so a FIFO cannot block."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _read_text(path: str, limit: int) -> bytes:
    """Up to `limit` bytes of `path` if they are readable UTF-8 text without NUL bytes, else b""."""
    chunks, left = [], limit
    try:
        with open(path, "rb") as f:
            while left > 0:  # read(limit) would allocate `limit` bytes up front
                chunk = f.read(min(left, _READ_CHUNK))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
    except OSError:
        return b""
    data = b"".join(chunks)
    if b"\0" in data:
        return b""
    try:
        # A file cut at `limit` may end inside a multi-byte character.
        codecs.getincrementaldecoder("utf-8")().decode(data, final=len(data) < limit)
    except UnicodeDecodeError:
        return b""
    return data


def load_corpus(path: str | os.PathLike | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """Reads a text corpus as bytes.

    Reads one text file, or every text file under a directory (recursively, in
    sorted order, hidden entries skipped), or with `path=None` the Python
    standard library's source (`stdlib_corpus_files`). Files that are not UTF-8
    text (binary files) and entries that are not regular files (FIFOs,
    sockets, devices: never opened, so reading cannot block) are skipped.
    Files are joined with a newline and the result is cut at `max_bytes`; no
    more than `max_bytes` bytes are read.

    Args:
        path: a text file or a directory of text files; None for the standard
            library.
        max_bytes: the most bytes to return, at least 1.

    Returns:
        The corpus, at most `max_bytes` long and never empty.

    Raises:
        ValueError: if `path` does not exist, is neither a regular file nor a
            directory, holds no non-empty text file, or `max_bytes` is not a
            positive integer.

    Example:

    >>> len(load_corpus(max_bytes=1000))
    1000
    """
    _validate.integer("max_bytes", max_bytes, where=" of load_corpus()")
    if path is None:
        files = stdlib_corpus_files()
        source = "the Python standard library"
    else:
        path = os.fspath(path)
        source = repr(path)
        try:
            mode = os.stat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            raise ValueError(
                f"Corpus path {path!r} does not exist. Expected a text file or a directory of text files."
            ) from None
        except OSError as e:
            raise ValueError(f"Corpus path {path!r} cannot be read: {e.strerror}.") from None
        if stat.S_ISDIR(mode):
            files = _walk_sorted(path, lambda d: d.startswith(".") or d == "__pycache__")
            files = [f for f in files if not os.path.basename(f).startswith(".")]
        elif stat.S_ISREG(mode):
            files = [path]
        else:
            raise ValueError(
                f"Corpus path {path!r} is {_kind(mode)}, not a regular file. Expected a text file or a "
                "directory of text files."
            )
    pieces, size, irregular = [], 0, []
    for f in files:
        if not _is_regular_file(f):
            irregular.append(f)
            continue
        text = _read_text(f, max_bytes - size)
        if not text:
            continue
        if pieces:
            pieces.append(_SEPARATOR)
            size += len(_SEPARATOR)
        pieces.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    if not pieces:
        skipped = f"; not regular files, skipped: {irregular}" if irregular else ""
        raise ValueError(
            f"Corpus path {source} holds no text: expected a text file or a directory containing at least "
            f"one non-empty, readable UTF-8 text file (binary files are skipped; "
            f"{len(files) - len(irregular)} file(s) found{skipped})."
        )
    return b"".join(pieces)[:max_bytes]


def _check_positive_int(name: str, value) -> None:
    if not _validate.is_integer(value, minimum=1):
        raise ValueError(f"{name} must be a positive integer. Received: {name}={value!r}.")


def _split_point(num_bytes: int, heldout_fraction: float) -> int:
    """Index of the first held-out byte: the last `heldout_fraction` of the stream is held out."""
    return num_bytes - math.ceil(num_bytes * heldout_fraction)


def window_counts(
    num_bytes: int, *, seq_len: int, heldout_fraction: float = 0.05, batch_multiple: int = 1
) -> tuple[int, int]:
    """The numbers of training and held-out examples `lm_datasets` makes from `num_bytes` bytes.

    Args:
        num_bytes: the corpus length.
        seq_len: tokens per example.
        heldout_fraction: the share of the corpus held out.
        batch_multiple: as in `lm_datasets`: each count is rounded down to a multiple of it.

    Returns:
        `(train_windows, heldout_windows)`.

    Example:

    >>> window_counts(1000, seq_len=9, heldout_fraction=0.1)
    (90, 10)
    >>> window_counts(1000, seq_len=9, heldout_fraction=0.1, batch_multiple=4)
    (88, 8)
    """
    split = _split_point(num_bytes, heldout_fraction)
    counts = split // (seq_len + 1), (num_bytes - split) // (seq_len + 1)
    return tuple(n - n % batch_multiple for n in counts)


def _windows(stream: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping windows of seq_len + 1 bytes, split into (inputs, next-byte targets)."""
    n = len(stream) // (seq_len + 1)
    windows = stream[: n * (seq_len + 1)].reshape(n, seq_len + 1).astype(np.int32)
    return windows[:, :-1], windows[:, 1:]


def lm_datasets(
    corpus: bytes,
    *,
    seq_len: int,
    global_batch_size: int,
    heldout_fraction: float = 0.05,
    seed: int,
    repeat: bool = False,
    batch_multiple: int = 1,
) -> tuple[tf.data.Dataset, tf.data.Dataset]:
    """Splits a byte corpus into next-byte-prediction datasets for training and evaluation.

    The last `heldout_fraction` of the byte stream is held out; the rest is for
    training, so the two never share a byte. Each part is cut into
    non-overlapping windows of `seq_len + 1` bytes; a window gives the inputs
    `w[:-1]` and the targets `w[1:]`, both int32 of shape `(seq_len,)`.
    Training windows are shuffled with `seed` (a new, deterministic order every
    epoch); held-out windows keep their order. Both datasets are batched by the
    GLOBAL batch size: under a strategy, Keras splits each batch over the
    replicas. The last batch of a pass may be smaller.

    Args:
        corpus: the bytes to learn from.
        seq_len: tokens per example, at least 1.
        global_batch_size: examples per step over all replicas, at least 1.
        heldout_fraction: the share of the corpus held out, in (0, 1).
        seed: the shuffle seed.
        repeat: repeat the training windows without end, reshuffled each
            pass, so that every training batch is full (for training by a
            number of steps rather than by passes over the corpus).
        batch_multiple: every batch, the last of a pass too, holds a multiple
            of this many examples: the last windows of each part past a
            multiple of it are left out (fewer than `batch_multiple`). For
            `tfdist.ModelParallelStrategy`, whose batches must divide by the
            mesh's batch axis. `global_batch_size` must be a multiple of it.

    Returns:
        `(train_ds, heldout_ds)`, each yielding `(inputs, targets)` batches.

    Raises:
        ValueError: if a size is not a positive integer, `heldout_fraction` is
            outside (0, 1), `global_batch_size` is not a multiple of
            `batch_multiple`, or the corpus is too small for one training and
            one held-out window (of each, `batch_multiple`).

    Example:

    >>> train, heldout = lm_datasets(b"abcdefghij" * 20, seq_len=4, global_batch_size=8, seed=0)
    >>> inputs, targets = next(iter(heldout))
    >>> inputs.shape, targets.shape
    (TensorShape([2, 4]), TensorShape([2, 4]))
    """
    import tensorflow as tf

    _check_positive_int("seq_len", seq_len)
    _check_positive_int("global_batch_size", global_batch_size)
    _check_positive_int("batch_multiple", batch_multiple)
    if global_batch_size % batch_multiple:
        raise ValueError(
            f"global_batch_size must be a multiple of batch_multiple. Received: global_batch_size={global_batch_size}, "
            f"batch_multiple={batch_multiple}."
        )
    if not _validate.is_number(heldout_fraction) or not 0 < heldout_fraction < 1:
        raise ValueError(
            f"heldout_fraction must be a number in (0, 1). Received: heldout_fraction={heldout_fraction!r}."
        )
    stream = np.frombuffer(bytes(corpus), dtype=np.uint8)
    split = _split_point(len(stream), heldout_fraction)
    train_x, train_y = _windows(stream[:split], seq_len)
    heldout_x, heldout_y = _windows(stream[split:], seq_len)
    train_x, train_y, heldout_x, heldout_y = (
        a[: len(a) - len(a) % batch_multiple] for a in (train_x, train_y, heldout_x, heldout_y)
    )
    if not len(train_x) or not len(heldout_x):
        need = math.ceil(batch_multiple * (seq_len + 1) / min(heldout_fraction, 1 - heldout_fraction))
        raise ValueError(
            f"The corpus ({len(stream)} bytes) is too small for seq_len={seq_len} with "
            f"heldout_fraction={heldout_fraction}: it gives {len(train_x)} training and {len(heldout_x)} "
            f"held-out window(s) of seq_len + 1 = {seq_len + 1} bytes. Use a corpus of at least "
            f"{need} bytes or a smaller seq_len."
        )
    train = tf.data.Dataset.from_tensor_slices((train_x, train_y))
    train = train.shuffle(len(train_x), seed=seed, reshuffle_each_iteration=True)
    if repeat:
        train = train.repeat()
    train = train.batch(global_batch_size).prefetch(tf.data.AUTOTUNE)
    heldout = tf.data.Dataset.from_tensor_slices((heldout_x, heldout_y)).batch(global_batch_size)
    return train, heldout.prefetch(tf.data.AUTOTUNE)

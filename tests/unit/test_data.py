"""tfdist.data: corpus discovery and loading, and the next-byte datasets cut from it."""

import os
import re

import numpy as np
import pytest

from tfdist import data


def _examples(ds):
    """All (inputs, targets) rows of a batched dataset, as bytes."""
    rows = []
    for inputs, targets in ds:
        for x, y in zip(inputs.numpy(), targets.numpy(), strict=True):
            rows.append((bytes(x.astype(np.uint8)), bytes(y.astype(np.uint8))))
    return rows


def test_stdlib_corpus_files_are_the_standard_library_sources():
    files = data.stdlib_corpus_files()
    names = {os.path.relpath(f, os.path.dirname(os.__file__)) for f in files}
    assert {"os.py", "json/__init__.py"} <= names
    assert all(f.endswith(".py") for f in files)
    assert not [f for f in files if "site-packages" in f.split(os.sep)]
    assert not [f for f in files if "test" in f.split(os.sep)]
    assert files == data.stdlib_corpus_files()  # deterministic


def test_load_corpus_defaults_to_the_standard_library():
    corpus = data.load_corpus(max_bytes=5000)
    assert len(corpus) == 5000
    assert corpus == data.load_corpus(max_bytes=5000)
    first = data.stdlib_corpus_files()[0]
    with open(first, "rb") as f:
        assert corpus.startswith(f.read()[:100])


def test_load_corpus_reads_a_directory_of_text_and_skips_binary(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")  # not UTF-8
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("third")
    assert data.load_corpus(tmp_path) == b"first\nsecond\nthird"
    assert data.load_corpus(str(tmp_path / "b.txt")) == b"second"
    assert data.load_corpus(tmp_path, max_bytes=8) == b"first\nse"


def test_load_corpus_missing_path_names_it(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match=f"{missing!r} does not exist.*text file or a directory"):
        data.load_corpus(missing)


@pytest.mark.parametrize(
    "files",
    [{}, {"empty.txt": b""}, {"a.bin": b"\x00\xff\x00", "b.png": b"\x89PNG\r\n\x1a\n\x00\x00"}],
    ids=["empty_dir", "empty_file", "binary_only"],
)
def test_load_corpus_without_text_names_the_path(tmp_path, files):
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=f"{str(tmp_path)!r} holds no text.*non-empty.*UTF-8 text file"):
        data.load_corpus(tmp_path)


def test_load_corpus_refuses_a_path_that_is_not_a_regular_file(tmp_path):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=rf"{re.escape(repr(fifo))} is a FIFO, not a regular file\. Expected a text"):
        data.load_corpus(fifo)
    with pytest.raises(ValueError, match=r"'/dev/zero' is a character device, not a regular file"):
        data.load_corpus("/dev/zero")


def test_load_corpus_skips_fifos_in_a_directory_without_opening_them(tmp_path):
    os.mkfifo(tmp_path / "a_pipe")  # sorted first: opening it for reading would block for ever
    (tmp_path / "b.txt").write_text("text")
    assert data.load_corpus(tmp_path) == b"text"
    (tmp_path / "b.txt").unlink()
    skipped = re.escape(f"0 file(s) found; not regular files, skipped: [{str(tmp_path / 'a_pipe')!r}]")
    with pytest.raises(ValueError, match=rf"holds no text.*{skipped}"):
        data.load_corpus(tmp_path)


def test_load_corpus_reads_no_more_than_max_bytes(tmp_path):
    huge = tmp_path / "huge.txt"
    with open(huge, "wb") as f:
        f.write(b"text")
        f.truncate(2**40)  # a sparse 1 TiB file: reading it whole fails
    assert data.load_corpus(huge, max_bytes=4) == b"text"
    huge.unlink()
    (tmp_path / "a.txt").write_text("x" * 5000)
    (tmp_path / "b.txt").write_text("y" * 5000)
    # read(max_bytes) would allocate max_bytes up front (MemoryError); a file cut inside a
    # multi-byte character is still text.
    assert data.load_corpus(tmp_path, max_bytes=10**15) == b"x" * 5000 + b"\n" + b"y" * 5000
    (tmp_path / "c.txt").write_text("é" * 10, encoding="utf-8")
    assert data.load_corpus(tmp_path / "c.txt", max_bytes=3) == "é".encode() + b"\xc3"


def test_load_corpus_rejects_non_positive_max_bytes():
    with pytest.raises(ValueError, match="max_bytes=0"):
        data.load_corpus(max_bytes=0)


def test_windows_are_disjoint_shifted_by_one_and_held_out_last():
    seq_len, size = 8, 20_000
    corpus = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
    train, heldout = data.lm_datasets(corpus, seq_len=seq_len, global_batch_size=32, seed=1)
    train_rows, heldout_rows = _examples(train), _examples(heldout)
    assert (len(train_rows), len(heldout_rows)) == data.window_counts(size, seq_len=seq_len)
    assert len(heldout_rows) == (size // 20) // (seq_len + 1)  # the last 5% of the bytes

    def offset(inputs, targets):
        assert inputs[1:] == targets[:-1]  # targets are the inputs shifted by one byte
        window = inputs + targets[-1:]
        at = corpus.find(window)
        assert at >= 0 and at % (seq_len + 1) in (0, (size - size // 20) % (seq_len + 1))
        return at

    train_at = sorted(offset(*row) for row in train_rows)
    heldout_at = [offset(*row) for row in heldout_rows]
    assert heldout_at == sorted(heldout_at)  # held-out windows keep their order
    starts = train_at + heldout_at
    assert all(b - a >= seq_len + 1 for a, b in zip(starts, starts[1:], strict=False))  # no shared byte
    assert max(train_at) + seq_len + 1 <= min(heldout_at)


def test_training_batches_are_global_shuffled_and_seeded():
    corpus = np.random.default_rng(2).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    kwargs = dict(seq_len=15, global_batch_size=24, seed=3)
    train, _ = data.lm_datasets(corpus, **kwargs)
    first, second = ([x.numpy() for x, _ in train] for _ in range(2))
    again = [x.numpy() for x, _ in data.lm_datasets(corpus, **kwargs)[0]]
    n_train = data.window_counts(len(corpus), seq_len=15)[0]
    assert [len(x) for x in first] == [24] * (n_train // 24) + [n_train % 24]
    assert not np.array_equal(first[0], second[0])  # reshuffled each pass
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))  # same seed, same order
    assert sorted(map(bytes, np.concatenate(first))) == sorted(map(bytes, np.concatenate(second)))


def test_repeat_gives_full_batches_forever():
    train, _ = data.lm_datasets(b"x" * 1000, seq_len=9, global_batch_size=7, seed=0, repeat=True)
    sizes = [int(x.shape[0]) for x, _ in train.take(30)]
    assert sizes == [7] * 30  # 95 windows: would end with a batch of 4 without repeat


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(global_batch_size=0), r"global_batch_size must be a positive integer\. Received: global_batch_size=0"),
        (dict(global_batch_size=-3), r"global_batch_size must be a positive integer\. Received: global_batch_size=-3"),
        (dict(global_batch_size=2.0), r"global_batch_size must be a positive integer"),
        (dict(seq_len=0), r"seq_len must be a positive integer\. Received: seq_len=0"),
        (dict(heldout_fraction=0), r"heldout_fraction must be a number in \(0, 1\)"),
        (dict(heldout_fraction=1.0), r"heldout_fraction must be a number in \(0, 1\)"),
        (dict(seq_len=500), r"too small for seq_len=500.*1 training and 0 held-out"),
    ],
)
def test_lm_datasets_rejects_bad_arguments(kwargs, message):
    args = {"seq_len": 8, "global_batch_size": 4, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        data.lm_datasets(b"abc" * 300, **args)

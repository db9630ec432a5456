"""The checkpoint file format: writing, reading, validating and listing files, cleaning up temporaries.

A checkpoint is ONE file, `<prefix>-<step>.npz`: an uncompressed zip of one
`.npy` member per variable plus a `__meta__` JSON member (variable paths,
shapes and dtypes, step, epoch, logs). `save` follows TensorFlow's
`distributed_file_utils`: the chief writes into the real directory, other
workers into a private temporary directory of their own that they delete. A
file is written under a new hidden temporary name (created exclusively, with a
random part, never through a symlink), flushed, fsync'ed and renamed
(`os.replace`), so a crash leaves either the previous set of checkpoints or the
new complete one, never a half file under a checkpoint name; a failed write
(disk full) raises `CheckpointWriteError` naming the file and removes the
temporary file. Readers check the zip's CRCs and the whole structure (metadata
types, each `.npy` header's dtype and shape against the metadata and against
the bytes the member holds) before allocating anything, and skip damaged or
malformed files with a warning naming them and the reason.

Nothing here imports TensorFlow: it reads and writes numpy arrays.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import shutil
import tempfile
import warnings
import zipfile

import numpy as np

from tfdist import _validate

_META = "__meta__"
FORMAT = "tfdist-checkpoint-1"


class CheckpointCorruptWarning(UserWarning):
    """A checkpoint file was skipped because it is truncated or corrupt."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, directory not writable); nothing was written under its name."""


# ------------------------------------------------------------------ names, writing
def checkpoint_name(prefix: str, step: int) -> str:
    return f"{prefix}-{step:09d}.npz"


def list_checkpoints(directory: str, prefix: str) -> list[tuple[int, str]]:
    """(step, path) of the files named like checkpoints in `directory`, oldest first (unvalidated)."""
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)\.npz$")
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), os.path.join(directory, n)) for n in names if (m := pattern.match(n))]
    return sorted(found)


def _fsync_dir(directory: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# A new file only: fails on anything already at the name, a symlink included (even a dangling one).
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp-[0-9a-z_]+$")  # `.<final name>.tmp-<random>` (also older `-<pid>`)


def _write_error(path: str, error: OSError) -> CheckpointWriteError:
    return CheckpointWriteError(
        error.errno,
        f"Cannot write {path!r}: {error.strerror or error}. Nothing was written under that name and the files "
        "already there are intact; free disk space or make the directory writable, then try again.",
    )


@contextlib.contextmanager
def _atomic_file(path: str):
    """A binary file whose bytes appear under `path` only once complete: temp name, fsync, rename.

    The temporary file `.<name>.tmp-<random>` is created exclusively (`O_EXCL |
    O_NOFOLLOW`, so nothing planted at a name can be written through) with the
    default permissions (0o666 less the umask), and removed on any error. The
    rename replaces whatever is at `path`, a symlink itself rather than its target.
    """
    directory = os.path.dirname(path) or "."
    temp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{secrets.token_hex(8)}")
    fd = os.open(temp, _CREATE_FLAGS, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temp)
        raise
    _fsync_dir(directory)


def write_file(path: str, paths, arrays, meta: dict) -> int:
    """Writes one checkpoint file atomically (temp name, fsync, rename); returns its size in bytes.

    Raises:
        CheckpointWriteError: when the file cannot be written (disk full, not
            writable), naming `path`; the temporary file is removed and any
            earlier file under `path` is left as it was.
    """
    meta = {
        **meta,
        "format": FORMAT,
        "paths": list(paths),
        "shapes": [list(a.shape) for a in arrays],
        "dtypes": [str(a.dtype) for a in arrays],
    }
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with _atomic_file(path) as f:
            with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
                z.writestr(_META, json.dumps(meta))
                for i, a in enumerate(arrays):
                    with z.open(f"{i:06d}.npy", "w", force_zip64=True) as member:
                        np.lib.format.write_array(member, np.asarray(a, order="C"), allow_pickle=False)
        return os.path.getsize(path)
    except OSError as e:
        raise _write_error(path, e) from e


def write_keras_model(model, path: str) -> None:
    """Saves `model` as a `.keras` file atomically: staged in a private temporary directory, fsync'ed, renamed.

    Raises:
        CheckpointWriteError: when the file cannot be written, naming `path`;
            nothing is left under `path` but what was there before.
    """
    directory, name = os.path.dirname(path) or ".", os.path.basename(path)
    try:
        staging = tempfile.mkdtemp(dir=directory, prefix=f".{name}.tmp-")  # mode 0o700, a new directory
        try:
            staged = os.path.join(staging, name)
            model.save(staged)
            fd = os.open(staged, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(staged, path)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as e:
        raise _write_error(path, e) from e
    _fsync_dir(directory)


def _remove_entries(directory: str, matches) -> None:
    """Deletes the entries of `directory` whose name `matches`, never following a symlink.

    A symlink or file is unlinked (the link itself, not its target); a real
    directory is removed with `shutil.rmtree`, which does not follow symlinks in it.
    """
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        if matches(entry.name):
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.remove(entry.path)


def remove_stale_temps(directory: str, *, ending: str = ".npz") -> None:
    """Deletes what interrupted writes of `*<ending>` files left in `directory` (call before writing there)."""

    def stale(name):
        found = _TEMP.match(name)
        return found is not None and found.group("name").endswith(ending)

    _remove_entries(directory, stale)


# ------------------------------------------------------------------ reading and validating
def _is_shape(value) -> bool:
    return isinstance(value, list) and all(_validate.is_integer(d) and d >= 0 for d in value)


# The metadata keys a reader relies on: what each must be when present.
_META_SCHEMA = {
    "format": (lambda v: v == FORMAT, f"{FORMAT!r}"),
    "step": (lambda v: _validate.is_integer(v) and v >= 0, "an integer >= 0"),
    "paths": (lambda v: isinstance(v, list) and all(isinstance(p, str) for p in v), "a list of strings"),
    "shapes": (lambda v: isinstance(v, list) and all(_is_shape(s) for s in v), "a list of shapes (integer lists)"),
    "dtypes": (lambda v: isinstance(v, list) and all(isinstance(d, str) for d in v), "a list of dtype names"),
    "epoch": (lambda v: v is None or (_validate.is_integer(v) and v >= 0), "an integer >= 0 or null"),
    "batch": (lambda v: _validate.is_integer(v) and v >= 0, "an integer >= 0"),
    "logs": (
        lambda v: isinstance(v, dict) and all(_validate.is_number(x) for x in v.values()),
        "an object of numbers",
    ),
    "include_optimizer": (lambda v: isinstance(v, bool), "true or false"),
    "monitor": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "monitor_value": (lambda v: v is None or _validate.is_number(v), "a number or null"),
    "metrics": (lambda v: v is None or (isinstance(v, list) and all(isinstance(m, list) for m in v)), "lists"),
    "iterator": (
        lambda v: (
            v is None
            or (
                isinstance(v, dict)
                and all(_validate.is_integer(v.get(k), minimum=0) for k in ("ordinal", "drawn", "created"))
            )
        ),
        "null or an object of integers ordinal, drawn, created",
    ),
}
_ALWAYS = ("format", "step", "paths", "shapes", "dtypes")
_ARRAY_KINDS = "biufcV"  # bool, integers, floats, complex; "V": ml_dtypes' bfloat16 & co. (not structured)


def _check_meta(meta, required=()) -> dict:
    """`meta` when it is checkpoint metadata a reader can rely on; else ValueError saying what is wrong."""
    if not isinstance(meta, dict):
        raise ValueError(f"its {_META} member is a JSON {type(meta).__name__}, not an object")
    missing = [key for key in (*_ALWAYS, *required) if key not in meta]
    if missing:
        raise ValueError(f"its metadata lacks {missing}")
    for key, (valid, expected) in _META_SCHEMA.items():
        if key in meta and not valid(meta[key]):
            raise ValueError(f"metadata {key!r} is {_short(meta[key])}, expected {expected}")
    counts = {key: len(meta[key]) for key in ("paths", "shapes", "dtypes")}
    if len(set(counts.values())) != 1:
        raise ValueError(f"the metadata lists different numbers of paths, shapes and dtypes: {counts}")
    for i, name in enumerate(meta["dtypes"]):
        try:
            dtype = np.dtype(name)
        except (TypeError, ValueError) as e:
            raise ValueError(f"metadata dtype #{i} {name!r} is not a dtype") from e
        if dtype.kind not in _ARRAY_KINDS or dtype.names is not None or dtype.subdtype is not None:
            raise ValueError(f"metadata dtype #{i} {name!r} is not a numeric dtype")
    return meta


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _stored_members(z: zipfile.ZipFile, file_size: int) -> dict:
    """The zip's members by name, after checking each is stored whole (uncompressed) within the file."""
    members = {}
    for info in z.infolist():
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
            raise ValueError(f"member {info.filename} is compressed; a checkpoint stores its members")
        if info.header_offset + info.compress_size > file_size:
            raise ValueError(f"member {info.filename} claims {info.file_size} bytes, more than the file's {file_size}")
        members[info.filename] = info
    return members


def _read_npy(z: zipfile.ZipFile, info: zipfile.ZipInfo, shape: tuple, dtype: np.dtype) -> np.ndarray:
    """One `.npy` member, after checking its header against the metadata and the member's size."""
    with z.open(info) as member:
        version = np.lib.format.read_magic(member)
        if version == (1, 0):
            header_shape, fortran_order, header_dtype = np.lib.format.read_array_header_1_0(member)
        elif version == (2, 0):
            header_shape, fortran_order, header_dtype = np.lib.format.read_array_header_2_0(member)
        else:
            raise ValueError(f"member {info.filename} is .npy version {version}, not 1.0 or 2.0")
        # ml_dtypes' types (bfloat16, ...) are written as raw bytes of their size ("V2" for bfloat16).
        raw_bytes_of = dtype.kind == "V" and header_dtype == np.dtype(f"V{dtype.itemsize}")
        if header_dtype != dtype and not raw_bytes_of:
            raise ValueError(f"member {info.filename} holds dtype {header_dtype}, the metadata says {dtype}")
        if header_shape != shape:
            raise ValueError(f"member {info.filename} holds shape {header_shape}, the metadata says {shape}")
        nbytes = math.prod(shape) * dtype.itemsize
        if member.tell() + nbytes != info.file_size:
            raise ValueError(
                f"member {info.filename} holds {info.file_size - member.tell()} bytes of data, its header "
                f"claims {nbytes}"
            )
        data = member.read(nbytes)  # reading to the member's end makes zipfile check its CRC
        if len(data) != nbytes:
            raise ValueError(f"member {info.filename} ends after {len(data)} of its {nbytes} bytes")
    array = np.frombuffer(data, dtype=dtype)
    return array.reshape(shape[::-1]).T if fortran_order else array.reshape(shape)


_READ_ERRORS = (OSError, ValueError, KeyError, EOFError, RecursionError, zipfile.BadZipFile)


def _corrupt(path: str, reason) -> ValueError:
    return ValueError(f"checkpoint {path} is truncated or corrupt: {reason}")


def read_meta(path: str) -> dict:
    """The checked metadata of a checkpoint file (reads only its `__meta__` member).

    Raises:
        ValueError: when the file or its metadata is damaged, naming the file.
    """
    try:
        with open(path, "rb") as f, zipfile.ZipFile(f) as z:
            _stored_members(z, os.fstat(f.fileno()).st_size)
            return _check_meta(json.loads(z.read(_META)))
    except _READ_ERRORS as e:
        raise _corrupt(path, e) from e


def read_file(path: str, *, required=()) -> tuple[dict, list[np.ndarray]]:
    """(metadata, arrays) of a checkpoint file, its whole structure checked before anything is allocated.

    Checked: the zip (every member stored within the file, each CRC as it is
    read), the metadata (an object with the keys in `_ALWAYS` and `required`,
    each of the expected type; as many paths as shapes and dtypes), and each
    `.npy` member (its header's dtype and shape equal the metadata's, its size
    equals what the header claims). The arrays are read-only views of the bytes.

    Raises:
        ValueError: when the file is truncated, corrupt or malformed, naming
            the file and the reason.
    """
    try:
        with open(path, "rb") as f, zipfile.ZipFile(f) as z:
            members = _stored_members(z, os.fstat(f.fileno()).st_size)
            if _META not in members:
                raise ValueError(f"it has no {_META} member")
            meta = _check_meta(json.loads(z.read(_META)), required)
            arrays = []
            for i, (shape, name) in enumerate(zip(meta["shapes"], meta["dtypes"])):
                member = f"{i:06d}.npy"
                if member not in members:
                    raise ValueError(f"member {member} is missing")
                arrays.append(_read_npy(z, members[member], tuple(shape), np.dtype(name)))
    except _READ_ERRORS as e:
        raise _corrupt(path, e) from e
    return meta, arrays


def newest_valid(directory: str, prefix: str, *, max_step: int | None = None, required=()):
    """(step, path, meta, arrays) of the newest intact checkpoint, warning about each one skipped; else None.

    A file is skipped when `read_file` rejects it or its metadata's step is not
    the one in its name.
    """
    for step, path in reversed(list_checkpoints(directory, prefix)):
        if max_step is not None and step > max_step:
            continue
        try:
            meta, arrays = read_file(path, required=required)
            if meta["step"] != step:
                raise _corrupt(path, f"its metadata says step {meta['step']}, its name step {step}")
        except ValueError as e:
            warnings.warn(f"Skipping {e} (using the next older one, if any)", CheckpointCorruptWarning, stacklevel=3)
            continue
        return step, path, meta, arrays
    return None


def check_writable_dir(name: str, directory) -> str:
    """Validates a checkpoint directory argument: a path that is (or can become) a writable directory."""
    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise _validate.invalid(name, directory, "a directory path")
    directory = os.fspath(directory)
    existing = directory
    while not os.path.exists(existing):
        parent = os.path.dirname(os.path.abspath(existing))
        if parent == os.path.abspath(existing):
            break
        existing = parent
    if os.path.exists(existing) and not os.path.isdir(existing):
        raise _validate.invalid(name, directory, "a directory path", problem=f"{existing!r} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise _validate.invalid(
            name, directory, "a writable directory", problem=f"directory {existing!r} is not writable by this process"
        )
    return directory


def save(directory: str, prefix: str, step: int, paths, arrays, meta: dict, *, rank: int) -> str | None:
    """Writes a checkpoint the multi-worker-safe way; returns the real path on the chief, else None.

    The chief (rank 0) writes `directory/<prefix>-<step>.npz`; another worker
    writes the same bytes into a new private directory
    `directory/.worker-<rank>-tmp-<random>/` and deletes it, as TensorFlow's
    `distributed_file_utils` does (first deleting what an interrupted write of
    the same worker left).
    """
    name = checkpoint_name(prefix, step)
    if rank == 0:
        path = os.path.join(directory, name)
        write_file(path, paths, arrays, meta)
        return path
    own = re.compile(rf"^\.worker-{rank}-tmp-[0-9a-z_]+$")
    _remove_entries(directory, own.match)
    try:
        os.makedirs(directory, exist_ok=True)
        temp_dir = tempfile.mkdtemp(dir=directory, prefix=f".worker-{rank}-tmp-")
    except OSError as e:
        raise _write_error(os.path.join(directory, name), e) from e
    try:
        write_file(os.path.join(temp_dir, name), paths, arrays, meta)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    return None

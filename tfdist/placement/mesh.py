"""Device meshes: named axes over a list of devices (a DTensor `Mesh`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from collections.abc import Sequence

from tensorflow.experimental import dtensor

from tfdist import _validate
from tfdist import devices as devices_lib


def validate_axes(axes: Mapping[str, int]) -> dict[str, int]:
    """Returns `axes` as a plain dict after checking names and sizes.

    Raises:
        ValueError: if `axes` is not a non-empty mapping of distinct, non-empty
            string names to integer sizes >= 1.
    """
    if not isinstance(axes, Mapping) or not axes:
        raise ValueError(
            f'Invalid mesh: {axes!r}. Expected a non-empty dict of axis name -> size, e.g. {{"batch": 2, "model": 4}}.'
        )
    out = {}
    for name, size in axes.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(
                f"Invalid mesh axis name {name!r} in mesh {dict(axes)!r}. "
                'Axis names are identifiers such as "batch" or "model".'
            )
        if not _validate.is_integer(size, minimum=1):
            raise ValueError(
                f"Invalid size for mesh axis {name!r}: {size!r} (mesh {dict(axes)!r}). Expected an integer >= 1."
            )
        out[name] = size
    return out


def _short_device_name(name: str) -> str:
    """'/job:localhost/replica:0/task:0/device:CPU:3' -> 'CPU:3' (what DTensor's create_mesh takes)."""
    full = devices_lib.canonical_device(name)
    parts = full.split(":")
    return f"{parts[-2].split('/')[-1].upper()}:{parts[-1]}"


def make_mesh(axes: Mapping[str, int], devices: Sequence[str] | None = None) -> dtensor.Mesh:
    """Builds a DTensor mesh with named axes over local devices.

    The first axis varies slowest: on `{"batch": 2, "model": 4}` devices 0-3
    form the first model-parallel group and devices 4-7 the second.

    Args:
        axes: axis name -> size, in order, e.g. `{"batch": 2, "model": 4}`.
            The product of the sizes must equal the number of devices.
        devices: device names such as `["CPU:0", "CPU:1"]`. Defaults to all
            GPUs, else all logical CPUs (see `tfdist.simulate_devices`).

    Returns:
        A `tf.experimental.dtensor.Mesh`.

    Raises:
        ValueError: for bad axis names or sizes, unknown or repeated devices,
            devices of mixed types, or a mesh size that differs from the
            number of devices.

    Example:

    >>> import tfdist
    >>> from tfdist.placement import make_mesh
    >>> mesh = make_mesh({"batch": 1, "model": 1}, devices=["CPU:0"])
    >>> mesh.dim_names, mesh.shape()
    (['batch', 'model'], [1, 1])
    """
    axes = validate_axes(axes)
    names = [_short_device_name(d) for d in devices_lib.device_list(devices)]
    types = sorted({d.split(":")[0] for d in names})
    if len(types) > 1:
        raise ValueError(f"A mesh holds devices of one type; got {types} in {names}.")
    size = math.prod(axes.values())
    if size != len(names):
        shape = " x ".join(f"{k}={v}" for k, v in axes.items())
        raise ValueError(
            f"The mesh {dict(axes)!r} ({shape}) needs {size} devices, but {len(names)} are given: {names}. "
            f"Choose axis sizes whose product is {len(names)}, or pass `devices` with {size} devices "
            f"(on CPU: call tfdist.simulate_devices({size}) before TensorFlow starts)."
        )
    return dtensor.create_mesh(list(axes.items()), devices=names, device_type=types[0])


def mesh_axes(mesh: dtensor.Mesh) -> dict[str, int]:
    """The axis name -> size mapping of a DTensor mesh."""
    return dict(zip(mesh.dim_names, mesh.shape()))

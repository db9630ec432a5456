"""Device discovery and simulated devices.

TensorFlow fixes the set of logical devices when its runtime starts (the first
op, the first `tf.config.list_logical_devices()`, the first strategy). Splitting
the host CPU into several logical devices therefore has to happen before that;
`simulate_devices` does it and says clearly when it is too late. Importing this
module does not import TensorFlow (binaries check their flags against
`MAX_SIMULATED_DEVICES` first).

Example (first, before anything starts TensorFlow's runtime):

>>> import tfdist
>>> len(tfdist.simulate_devices(4))
4
>>> len(tfdist.devices.default_devices()) >= 1  # all GPUs if there are any, else the 4 CPUs
True
"""

from __future__ import annotations

import os

from tfdist import _validate

MAX_SIMULATED_DEVICES = 64
"""The most logical CPU devices `simulate_devices` makes (TensorFlow's start-up time grows with the count)."""


def simulate_devices(n: int) -> list[str]:
    """Splits the host CPU into `n` logical devices.

    Use it to run data- or model-parallel code on a machine without
    accelerators: each logical CPU is a separate device to `tf.distribute` and
    DTensor, with real collectives between them. Calling it again with the same
    `n` is a no-op.

    Args:
        n: number of logical CPU devices, from 1 to `MAX_SIMULATED_DEVICES`.

    Returns:
        The names of the logical CPU devices, e.g. `["/device:CPU:0", ...]`.

    Raises:
        ValueError: if `n` is not an integer from 1 to `MAX_SIMULATED_DEVICES`.
        RuntimeError: if TensorFlow's runtime is already initialized with a
            different number of logical CPUs.

    Example:

    >>> import tfdist
    >>> tfdist.simulate_devices(4)[-1]
    '/device:CPU:3'
    """
    _validate.integer("n", n, maximum=MAX_SIMULATED_DEVICES, where=" of simulate_devices()")
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
        )
    except RuntimeError as e:
        have = len(current) if current else 1
        if have != n:
            raise RuntimeError(
                f"simulate_devices({n}) was called after TensorFlow initialized its runtime "
                f"with {have} logical CPU device(s); the device list cannot change after that. "
                f"Call tfdist.simulate_devices({n}) first, before creating any tensor, model, "
                "strategy or calling tf.config.list_logical_devices() (in a notebook: restart "
                "the kernel and run it in the first cell)."
            ) from e
        return [d.name for d in tf.config.list_logical_devices("CPU")]
    # Listing logical devices would start TensorFlow's runtime, after which a process can no longer join a
    # multi-process DTensor mesh (ModelParallelStrategy across processes): name them without starting it.
    return [f"/device:CPU:{i}" for i in range(n)]


def host_memory() -> int | None:
    """Bytes of this machine's physical memory (shared by all logical CPU devices), or None when unknown.

    Example:

    >>> host_memory() > 0
    True
    """
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def default_devices() -> list[str]:
    """Returns the devices a data-parallel strategy uses by default.

    All GPUs when there are any, else all logical CPUs (one unless
    `simulate_devices` split the host).

    Example:

    >>> import tfdist
    >>> len(tfdist.devices.default_devices()) >= 1
    True
    """
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    if gpus:
        return [d.name for d in gpus]
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def canonical_device(name: str) -> str:
    """Returns `name` as a full logical device name, or raises naming the valid ones.

    Accepts short forms like "CPU:1", "gpu:0" or "/cpu:1".

    Raises:
        ValueError: if no logical device of that name exists.
    """
    import tensorflow as tf

    available = [d.name for d in tf.config.list_logical_devices()]
    try:
        spec = tf.DeviceSpec.from_string(name if name.startswith("/") else "/device:" + name)
    except (ValueError, TypeError):
        spec = None
    if spec is not None and spec.job in (None, "localhost") and spec.device_type is not None:
        for full in available:
            have = tf.DeviceSpec.from_string(full)
            if have.device_type == spec.device_type.upper() and have.device_index == (spec.device_index or 0):
                return full
    raise ValueError(
        f"Device {name!r} does not exist. Available logical devices: {available}. "
        "To get more CPU devices call tfdist.simulate_devices(n) before TensorFlow starts."
    )


def device_list(devices) -> list[str]:
    """Validates a `devices` argument: the full names of a non-empty list of distinct devices.

    None means `default_devices()`.

    Raises:
        ValueError: a string or an empty list, a device that does not exist, or a device given twice.
    """
    if devices is None:
        return default_devices()
    if isinstance(devices, str) or not list(devices):
        raise _validate.invalid(
            "devices", devices, "a non-empty list of device names such as ['CPU:0', 'CPU:1'], or None"
        )
    devices = [canonical_device(d) for d in devices]
    repeated = sorted({d for d in devices if devices.count(d) > 1})
    if repeated:
        raise ValueError(f"Each device may appear once in `devices`; repeated: {repeated}.")
    return devices

"""Sharded data parallelism: which dimension of each variable the data axis splits (ZeRO-1 / ZeRO-3, FSDP).

`AutoShard` decides, for one variable at a time, the layout it is stored in
on top of what the layout rules give it: the data axis (the mesh axis that
splits batches) is added on the largest dimension that the rules keep whole
and that the axis size divides. Each decision comes with a note that the
placement report prints ("split dim 0 over 'batch'", or why it stays
replicated over the data axis).

* `mode="weights"` (ZeRO-3 / FSDP): trainable weights are stored split and
  gathered (over the data axis only) for each use; their optimizer slots
  follow them, and their gradients come back split.
* `mode="optimizer"` (ZeRO-1): weights keep the rules' layout (replicated over
  the data axis); their optimizer slots are split. Each device updates its
  part, and the new weight is gathered when it is assigned.

Non-trainable variables (BatchNorm statistics, metrics) stay as the rules
place them, as FSDP leaves module buffers.
"""

from __future__ import annotations

import dataclasses
import math

MODES = ("optimizer", "weights")
# Below this many elements a variable stays replicated over the data axis (DeepSpeed's
# `stage3_param_persistence_threshold` idea): gathering it would cost a collective per use for bytes
# that barely count.
DEFAULT_MIN_SIZE = 1024


@dataclasses.dataclass(frozen=True)
class AutoShard:
    """How the data axis splits variables: the mode, the axis and its size, and the smallest size split.

    Args:
        mode: "optimizer" (ZeRO-1) or "weights" (ZeRO-3 / FSDP).
        axis: the mesh axis to split over (the one batches are split over).
        size: that axis' size.
        min_size: variables with fewer elements stay replicated over `axis`.

    Example:

    >>> plan = AutoShard(mode="weights", axis="batch", size=4, min_size=16)
    >>> plan.extend((None, None), (64, 256))
    ((None, 'batch'), "split dim 1 over 'batch'")
    >>> plan.extend((None,), (6,))[1]
    "replicated over 'batch': 6 elements < min_size 16"
    """

    mode: str
    axis: str
    size: int
    min_size: int = DEFAULT_MIN_SIZE

    def extend(self, spec: tuple, shape: tuple) -> tuple[tuple, str]:
        """`spec` with the data axis on one more dimension, and a note; `spec` itself and why when none fits."""
        spec, shape = tuple(spec), tuple(int(d) for d in shape)
        axis = self.axis
        if not shape:
            return spec, f"replicated over {axis!r}: a scalar"
        elements = math.prod(shape)
        if elements < self.min_size:
            return spec, f"replicated over {axis!r}: {elements:,} elements < min_size {self.min_size:,}"
        # A dimension that a layout rule splits holds its shard size on each device; the data axis splits another.
        free = [d for d, a in enumerate(spec) if a is None]
        fits = [d for d in free if shape[d] % self.size == 0]
        if not fits:
            whole = [shape[d] for d in free]
            return spec, (
                f"replicated over {axis!r}: no dimension the rules keep whole ({whole}) is divisible by "
                f"{self.size}"
            )
        dim = max(fits, key=lambda d: (shape[d], -d))  # the largest; the first of equals
        return spec[:dim] + (axis,) + spec[dim + 1 :], f"split dim {dim} over {axis!r}"

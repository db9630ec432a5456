"""The conformance matrix's columns and one family's cells, run in a process of 8 logical CPUs.

Usage (the parent, `python -m conformance`, starts it): python -m conformance.matrix OUT_FILE FAMILY COLUMN...

Each cell is `tfdist.check` of the family's model under the column's strategy against one device:
3 steps of SGD with momentum on 8 examples a step, the loss, every gradient and every variable on
every device compared within `tfdist.divergence.default_tolerance` (1e-5 of each variable's largest
entry). One JSON line per cell is appended to OUT_FILE as it finishes. The DTensor columns run last:
a DTensor runtime error poisons the process, so after one this process stops and the parent starts
another for the cells left.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import traceback
from collections.abc import Callable

STEPS, BATCH = 3, 8
MESH = {"batch": 2, "model": 4}


@dataclasses.dataclass(frozen=True)
class Column:
    """A strategy column of the matrix.

    Attributes:
        name: the key (`--columns`, the JSON).
        title: the table's header.
        strategy: builds the strategy from the family (`tfdist` is imported, 8 devices exist).
        dtensor: whether it runs on a DTensor mesh (run after the others, one error ends the process).
    """

    name: str
    title: str
    strategy: Callable
    dtensor: bool


def _data_parallel(family):
    import tfdist

    return tfdist.DataParallelStrategy(devices=[f"CPU:{i}" for i in range(4)], batch_statistics="global")


def _pipeline(family):
    import tfdist

    return tfdist.PipelineStrategy(stages=2, microbatches=2, devices=["CPU:0", "CPU:1"], batch_statistics="global")


def _model_parallel(family):
    import tfdist
    from tfdist import layouts

    return tfdist.ModelParallelStrategy(mesh=MESH, rules=layouts.auto())


def _layout_map(family):
    import keras

    import tfdist

    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), devices=[f"CPU:{i}" for i in range(8)])
    return tfdist.ModelParallelStrategy(mesh=MESH, rules=family.layout_map(mesh))


def _sharded(shard):
    def make(family):
        import tfdist

        return tfdist.ShardedDataParallelStrategy(shard=shard, min_size=16)

    return make


COLUMNS = {c.name: c for c in (
    Column("data_parallel", "DataParallel, 4 replicas", _data_parallel, False),
    Column("pipeline", "Pipeline, 2 stages x 2 micro-batches", _pipeline, False),
    Column("model_parallel", "ModelParallel auto() {batch 2, model 4}", _model_parallel, True),
    Column("layout_map", "ModelParallel, KerasHub's get_layout_map {2, 4}", _layout_map, True),
    Column("zero1", "ShardedDataParallel ZeRO-1, 8", _sharded("optimizer"), True),
    Column("zero3", "ShardedDataParallel ZeRO-3, 8", _sharded("weights"), True),
)}
"""Every column, in the matrix's order (the DTensor ones after the others)."""

NO_LAYOUT_MAP = "no get_layout_map in KerasHub 0.32 (Llama, Llama3, Gemma, Qwen, Qwen-MoE and Qwen3-MoE have one)"
PER_MICRO_BATCH = (
    "BatchNormalization normalizes each micro-batch with its own moments, as in every GPipe schedule "
    "(README, 'Layers that compute from the batch'; fit warns)"
)


def expected_reason(family, column: str) -> str | None:
    """Why the cell is not run, or is expected to differ from one device: a documented reason, else None."""
    if column == "layout_map" and family.layout_map is None:
        return NO_LAYOUT_MAP
    if column == "pipeline" and family.batch_statistics == "batch_norm":
        return PER_MICRO_BATCH
    return None


def _build(family):
    import keras

    def build():
        keras.utils.set_random_seed(3)
        model = family.model()
        keras.Model.compile(  # Keras' own compile: no task defaults (metrics, samplers)
            model,
            optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    return build


def _dropout_left(model) -> list[str]:
    import keras

    return [layer.path for layer in model._flatten_layers(include_self=False)
            if isinstance(layer, keras.layers.Dropout) and layer.rate > 0]


def cell(family, column: Column) -> dict:
    """One cell: `tfdist.check`'s report as plain data, with the status the matrix gives it."""
    import tfdist

    reason = expected_reason(family, column.name)
    if column.name == "layout_map" and family.layout_map is None:
        return {"status": "documented", "reason": reason}
    started = time.monotonic()
    try:
        report = tfdist.check(_build(family), family.data(STEPS * BATCH), column.strategy(family), steps=STEPS,
                              batch_size=BATCH)
    except Exception as e:  # noqa: BLE001 - the cell records the error; the matrix fails on it
        return {"status": "FAIL", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:400]}",
                "traceback": traceback.format_exc()[-3000:], "seconds": time.monotonic() - started}
    result = report.to_dict()
    result["text"] = str(report)
    if report.equal:
        result["status"] = "equal"
    elif reason is not None:
        result["status"], result["reason"] = "documented", reason
    else:
        result["status"] = "FAIL"
    return result


def main(argv: list[str]) -> int:
    out, name, columns = argv[0], argv[1], argv[2:]
    import tfdist

    tfdist.simulate_devices(8)
    from conformance.families import FAMILIES

    family = FAMILIES[name]
    dropout = _dropout_left(family.model())
    if dropout:
        raise AssertionError(f"{name}: Dropout left on in {dropout}; the matrix compares with dropout off")
    for column in columns:
        result = cell(family, COLUMNS[column])
        result.update(family=name, column=column)
        with open(out, "a") as f:
            f.write(json.dumps(result) + "\n")
        print(f"{name} {column}: {result['status']} {result.get('error', '')}", flush=True)
        if COLUMNS[column].dtensor and "error" in result:
            return 3  # the process may be poisoned: the parent starts another for the cells left
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

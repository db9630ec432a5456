"""The conformance matrix's columns and one family's cells, run in a process of 8 logical CPUs.

Usage (the parent, `python -m conformance`, starts it):
python -m conformance.matrix OUT_FILE FAMILY COLUMN... [--optimizer adam] [--aux-loss off]

Each cell is `tfdist.check` of the family's model under the column's strategy against one device:
3 steps on 8 examples a step (SGD with momentum, or the row's optimizer), the loss, every gradient and
every variable on every device compared within `tfdist.divergence.default_tolerance` (SGD: 1e-5 of each
variable's largest entry; Adam: loss and gradients 1e-4, values 1e-3). A row is a family with an
optimizer and, for an MoE, its load-balancing loss on or off (`Row`); the main matrix's rows are every
family with SGD and its defaults, the MoE grid's (`moe_rows`) the MoE families' other combinations.
One JSON line per cell is appended to OUT_FILE as it finishes. The DTensor columns run last:
a DTensor runtime error poisons the process, so after one this process stops and the parent starts
another for the cells left.
"""

from __future__ import annotations

import argparse
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


@dataclasses.dataclass(frozen=True)
class Row:
    """A row of the matrix: a family, the optimizer it trains with, and whether its load-balancing loss is on.

    Attributes:
        family: the family's name (`conformance.families.FAMILIES`).
        optimizer: a key of `OPTIMIZERS`.
        aux_loss: False builds an MoE with its router's load-balancing loss scaled by 0.
    """

    family: str
    optimizer: str = "sgd"
    aux_loss: bool = True

    @property
    def key(self) -> str:
        """The row's name in results.json and file names: "mixtral", "mixtral-adam-aux_off"."""
        return "-".join([self.family] + ([self.optimizer] if self.optimizer != "sgd" else [])
                        + ([] if self.aux_loss else ["aux_off"]))

    @property
    def title(self) -> str:
        """The row's name in the table: "mixtral" (SGD, defaults), "mixtral, Adam, aux loss off"."""
        if (self.optimizer, self.aux_loss) == ("sgd", True):
            return self.family
        return ", ".join([self.family, OPTIMIZERS[self.optimizer][0]] + ([] if self.aux_loss else ["aux loss off"]))

    def args(self) -> list[str]:
        """The options of `python -m conformance.matrix` that select this row's variant."""
        return ["--optimizer", self.optimizer, "--aux-loss", "on" if self.aux_loss else "off"]


def _sgd():
    import keras

    return keras.optimizers.SGD(0.1, momentum=0.9)


def _adam():
    import keras

    return keras.optimizers.Adam(1e-2)


OPTIMIZERS = {"sgd": ("SGD", _sgd), "adam": ("Adam", _adam)}
"""Each row's optimizer: its name in the table and a factory (SGD with momentum 0.9 at 0.1, Adam at 1e-2)."""

MOE = ("mixtral", "qwen_moe", "qwen3_moe", "gpt_oss")
"""The MoE families: their grid crosses Adam with SGD and, where the family has one, its load-balancing loss
off with on (SGD with it on is the main matrix's row)."""


def moe_rows(families) -> list[Row]:
    """The MoE grid's rows (`families`: name -> Family): Adam; with a balancing loss, it off under SGD and Adam."""
    rows = []
    for name in MOE:
        rows.append(Row(name, "adam"))
        if families[name].aux_loss is not None:
            rows += [Row(name, "sgd", aux_loss=False), Row(name, "adam", aux_loss=False)]
    return rows


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


def _model_parallel_1x8(family):
    import tfdist
    from tfdist import layouts

    return tfdist.ModelParallelStrategy(mesh={"batch": 1, "model": 8}, rules=layouts.auto())


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
    Column("model_parallel_1x8", "ModelParallel auto() {batch 1, model 8}", _model_parallel_1x8, True),
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


def _build(family, optimizer: str, aux_loss: bool):
    import keras

    def build():
        keras.utils.set_random_seed(3)
        model = family.build(aux_loss=aux_loss)
        keras.Model.compile(  # Keras' own compile: no task defaults (metrics, samplers)
            model,
            optimizer=OPTIMIZERS[optimizer][1](),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    return build


def _dropout_left(model) -> list[str]:
    import keras

    return [layer.path for layer in model._flatten_layers(include_self=False)
            if isinstance(layer, keras.layers.Dropout) and layer.rate > 0]


def cell(family, column: Column, *, optimizer: str = "sgd", aux_loss: bool = True) -> dict:
    """One cell: `tfdist.check`'s report as plain data, with the status the matrix gives it.

    `optimizer` (a key of `OPTIMIZERS`) and `aux_loss` select the row's variant (`Row`).
    """
    import tfdist

    reason = expected_reason(family, column.name)
    if column.name == "layout_map" and family.layout_map is None:
        return {"status": "documented", "reason": reason}
    started = time.monotonic()
    try:
        report = tfdist.check(_build(family, optimizer, aux_loss), family.data(STEPS * BATCH),
                              column.strategy(family), steps=STEPS, batch_size=BATCH)
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
    parser = argparse.ArgumentParser(prog="python -m conformance.matrix", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the JSON-lines file a line per cell is appended to")
    parser.add_argument("family")
    parser.add_argument("columns", nargs="+", choices=list(COLUMNS))
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default="sgd")
    parser.add_argument("--aux-loss", choices=("on", "off"), default="on")
    args = parser.parse_args(argv)
    out, name, columns = args.out, args.family, args.columns
    row = Row(name, args.optimizer, args.aux_loss == "on")
    import tfdist

    tfdist.simulate_devices(8)
    from conformance.families import FAMILIES

    family = FAMILIES[name]
    dropout = _dropout_left(family.build(aux_loss=row.aux_loss))
    if dropout:
        raise AssertionError(f"{name}: Dropout left on in {dropout}; the matrix compares with dropout off")
    for column in columns:
        result = cell(family, COLUMNS[column], optimizer=row.optimizer, aux_loss=row.aux_loss)
        result.update(family=name, row=row.key, column=column)
        with open(out, "a") as f:
            f.write(json.dumps(result) + "\n")
        print(f"{row.key} {column}: {result['status']} {result.get('error', '')}", flush=True)
        if COLUMNS[column].dtensor and "error" in result:
            return 3  # the process may be poisoned: the parent starts another for the cells left
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

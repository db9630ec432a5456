"""A representative handful of the conformance matrix's cells, and every family still building from config.

The whole matrix (`python3 dev.py conformance`, every KerasHub family of `conformance.families` under
every column, written to CONFORMANCE.md) runs by hand like the benchmarks. Here one child process with 8
logical CPUs (this file is also that child's script) builds every family once (KerasHub's configs change
between releases: a family that no longer builds, or whose Dropout is left on, fails here first) and runs
eight cells that cover the columns' different mechanisms and what each family once broke:
KerasHub's own layout map on a MoE (Qwen3-MoE), BatchNormalization with global statistics under data
parallelism (ResNet), a layer created inside another's `call` under data parallelism (EfficientNet's `Add`),
`layouts.auto()` on an encoder-decoder whose attention creates a weight in `__init__` (T5) and on rotary
attention with split heads (Gemma 3: the gradient of a stack), a pipeline (GPT-2), and the sharded modes over
depthwise convolutions (EfficientNet, ZeRO-3) and average pooling (DenseNet, ZeRO-1), whose gradients DTensor
cannot lay out. Each cell is the matrix's own (`conformance.matrix.cell`: `tfdist.check`, SGD with
momentum, every gradient and variable at every step within 1e-5 of one device's largest entry, atol 1e-7).
"""

import json
import os
import sys

if __name__ != "__main__":
    import _procs

CELLS = (
    ("qwen3_moe", "layout_map"),
    ("resnet", "data_parallel"),
    ("efficientnet", "data_parallel"),
    ("t5", "model_parallel"),
    ("gemma3", "model_parallel"),
    ("gpt2", "pipeline"),
    ("efficientnet", "zero3"),
    ("densenet", "zero1"),
)


def test_representative_cells_equal_one_device(tmp_path):
    result = _procs.run_child(os.path.abspath(__file__), tmp_path, timeout=600)
    from conformance.families import FAMILIES

    assert sorted(result["built"]) == sorted(FAMILIES), result["built"]
    assert all(not dropout for dropout in result["built"].values()), result["built"]
    for family, column in CELLS:
        cell = result["cells"][f"{family}/{column}"]
        assert cell["status"] == "equal", (family, column, cell.get("error") or cell.get("text"))
        largest = cell["largest"]
        assert max(largest["gradient"], largest["value"]) <= 1e-5, (family, column, largest)
        ratio = cell["device_bytes"] / cell["reference_bytes"]
        if column in ("zero3", "model_parallel", "layout_map"):
            assert ratio < 0.9, (family, column, ratio)  # weights really split over the mesh
        else:
            assert ratio <= 1.0, (family, column, ratio)


def test_the_matrix_names_a_reason_for_every_cell_it_does_not_run():
    from conformance import matrix
    from conformance.families import FAMILIES

    for family in FAMILIES.values():
        reason = matrix.expected_reason(family, "layout_map")
        assert (reason is None) == (family.layout_map is not None), family.name
        if family.batch_statistics == "batch_norm":
            assert matrix.expected_reason(family, "pipeline") == matrix.PER_MICRO_BATCH
        for column in ("data_parallel", "model_parallel", "zero1", "zero3"):
            assert matrix.expected_reason(family, column) is None, (family.name, column)


# ---------------------------------------------------------------- the child
def _child(out):
    import tfdist

    tfdist.simulate_devices(8)
    from conformance import matrix
    from conformance.families import FAMILIES

    built = {name: matrix._dropout_left(family.model()) for name, family in FAMILIES.items()}
    cells = {}
    for family, column in CELLS:
        cell = matrix.cell(FAMILIES[family], matrix.COLUMNS[column])
        cell.pop("traceback", None)
        cells[f"{family}/{column}"] = cell
        print(family, column, cell["status"], cell.get("error", ""), flush=True)
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"built": built, "cells": cells}, f)


if __name__ == "__main__":
    _child(sys.argv[1])

"""A representative handful of the conformance matrix's cells, the MoE acceptance, and every family still building.

The whole matrix and its MoE grid (`python3 dev.py conformance`, every KerasHub family of
`conformance.families` under every column, written to CONFORMANCE.md) run by hand like the benchmarks.
Here one child process with 8 logical CPUs (this file is also that child's script) builds every family
once (KerasHub's configs change between releases: a family that no longer builds, or whose Dropout is
left on, fails here first) and runs the matrix's own cells (`conformance.matrix.cell`: `tfdist.check`,
every gradient and variable at every step against one device):

- eight that cover the columns' different mechanisms and what each family once broke: KerasHub's own
  layout map on a MoE (Qwen3-MoE), BatchNormalization with global statistics under data parallelism
  (ResNet), a layer created inside another's `call` under data parallelism (EfficientNet's `Add`),
  `layouts.auto()` on an encoder-decoder whose attention creates a weight in `__init__` (T5) and on rotary
  attention with split heads (Gemma 3: the gradient of a stack), a pipeline (GPT-2), and the sharded modes
  over depthwise convolutions (EfficientNet, ZeRO-3) and average pooling (DenseNet, ZeRO-1), whose gradients
  DTensor cannot lay out;
- the MoE acceptance, Mixtral and Qwen3-MoE under ModelParallel `auto()` on {batch 2, model 4} and
  {batch 1, model 8} and both sharded modes, as a covering design: each family meets every
  (optimizer, load-balancing loss) pair once, each strategy meets SGD and Adam and the loss on and off;
  Qwen3-MoE also under DataParallel (SGD) and a pipeline (Adam: the embedding's sparse gradient, whose rows
  from the balancing loss through the earlier micro-batches must join their lookups' rows) with global-batch
  balancing. The full
  cross (every pair under every strategy, Qwen-MoE and GPT-OSS too) is the MoE grid of CONFORMANCE.md.

Tolerances (`tfdist.check`'s defaults): SGD with momentum, the loss, every gradient and every variable within
1e-5 of the one-device value's largest entry (atol 1e-7); Adam, the loss and gradients within 1e-4, the
variables within 1e-3 (Adam divides by a running gradient norm: rounding of a near-zero gradient entry moves
its update by up to the learning rate).
"""

import json
import os
import sys

import pytest

if __name__ != "__main__":
    import _procs

from conformance.matrix import Row

OFF = False  # the load-balancing loss scaled by 0
CELLS = (  # (row: family, optimizer, load-balancing loss on; column)
    (Row("qwen3_moe"), "layout_map"),
    (Row("resnet"), "data_parallel"),
    (Row("efficientnet"), "data_parallel"),
    (Row("t5"), "model_parallel"),
    (Row("gemma3"), "model_parallel"),
    (Row("gpt2"), "pipeline"),
    (Row("efficientnet"), "zero3"),
    (Row("densenet"), "zero1"),
    (Row("mixtral", "sgd", OFF), "model_parallel"),
    (Row("mixtral", "adam", OFF), "model_parallel_1x8"),
    (Row("mixtral", "sgd"), "zero1"),
    (Row("mixtral", "adam"), "zero3"),
    (Row("qwen3_moe", "adam"), "model_parallel"),
    (Row("qwen3_moe", "sgd"), "model_parallel_1x8"),
    (Row("qwen3_moe", "adam", OFF), "zero1"),
    (Row("qwen3_moe", "sgd", OFF), "zero3"),
    (Row("qwen3_moe", "sgd"), "data_parallel"),
    (Row("qwen3_moe", "adam"), "pipeline"),  # the balancing loss's sparse rows through earlier micro-batches
)
SPLIT = ("zero3", "model_parallel", "model_parallel_1x8", "layout_map")  # columns that split the weights
BOUNDS = {"sgd": {"loss": 1e-5, "gradient": 1e-5, "value": 1e-5}, "adam": {"loss": 1e-4, "gradient": 1e-4,
                                                                           "value": 1e-3}}


def _key(row, column):
    return f"{row.key}/{column}"


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return _procs.run_child(os.path.abspath(__file__), tmp_path_factory.mktemp("conformance"), timeout=600)


def test_every_family_builds_from_config_with_dropout_off(result):
    from conformance.families import FAMILIES

    assert sorted(result["built"]) == sorted(FAMILIES), result["built"]
    assert all(not dropout for dropout in result["built"].values()), result["built"]


@pytest.mark.parametrize("row, column", CELLS, ids=[_key(*c) for c in CELLS])
def test_cell_equals_one_device(result, row, column):
    cell = result["cells"][_key(row, column)]
    assert cell["status"] == "equal", cell.get("error") or cell.get("text")
    for kind, bound in BOUNDS[row.optimizer].items():
        assert cell["largest"][kind] <= bound, (kind, cell["largest"])
    ratio = cell["device_bytes"] / cell["reference_bytes"]
    if column in SPLIT:
        assert ratio < 0.9, ratio  # weights really split over the mesh
    else:
        assert ratio <= 1.0, ratio


def test_the_matrix_names_a_reason_for_every_cell_it_does_not_run():
    from conformance import matrix
    from conformance.families import FAMILIES

    for family in FAMILIES.values():
        reason = matrix.expected_reason(family, "layout_map")
        assert (reason is None) == (family.layout_map is not None), family.name
        if family.batch_statistics == "batch_norm":
            assert matrix.expected_reason(family, "pipeline") == matrix.PER_MICRO_BATCH
        for column in ("data_parallel", "model_parallel", "model_parallel_1x8", "zero1", "zero3"):
            assert matrix.expected_reason(family, column) is None, (family.name, column)


# ---------------------------------------------------------------- the child
def _child(out):
    import tfdist

    tfdist.simulate_devices(8)
    from conformance import matrix
    from conformance.families import FAMILIES

    built = {name: matrix._dropout_left(family.model()) for name, family in FAMILIES.items()}
    cells = {}
    for row, column in CELLS:
        cell = matrix.cell(FAMILIES[row.family], matrix.COLUMNS[column], optimizer=row.optimizer,
                           aux_loss=row.aux_loss)
        cell.pop("traceback", None)
        cells[_key(row, column)] = cell
        print(_key(row, column), cell["status"], f"{cell.get('seconds', 0):.1f} s", cell.get("error", ""), flush=True)
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"built": built, "cells": cells}, f)


if __name__ == "__main__":
    _child(sys.argv[1])

"""Keras' own distribution tests, from the installed Keras, under tfdist.DataParallelStrategy (not MirroredStrategy).

`keras/src/backend/tensorflow/distribute_test.py` and `optimizer_distribute_test.py` check tf.distribute's
contracts as Keras relies on them: variable creation, aggregation and synchronization, `strategy.run`,
the epoch iterator, seed generators, a regularized `fit` against numbers, and the optimizer applied
in replica context (single step, weight decay, a golden trajectory, clipping, EMA, gradient
accumulation summed over replicas). The files are copied, every `tf.distribute.MirroredStrategy([...])`
replaced, and run by pytest in a process of their own (they configure devices).
"""

import os
import re
import sys
import xml.etree.ElementTree as ElementTree

import _procs
import keras

KERAS_TESTS = os.path.join(os.path.dirname(keras.src.__file__), "backend", "tensorflow")
FILES = ("distribute_test.py", "optimizer_distribute_test.py")
MIRRORED = re.compile(r"tf\.distribute\.MirroredStrategy\((\[[^\]]*\])\)")
# The one skip is Keras' own: a parameter case that compares with the tf_keras package, not installed.
ALLOWED_SKIPS = {"tf_keras not installed"}


def _ported(source: str) -> str:
    ported, replaced = MIRRORED.subn(r"tfdist.DataParallelStrategy(devices=\1)", source)
    assert replaced and "MirroredStrategy(" not in ported, "a test would still run on MirroredStrategy"
    return ported.replace("import tensorflow as tf\n", "import tensorflow as tf\n\nimport tfdist\n", 1)


def test_keras_distribute_tests_pass_under_data_parallel_strategy(tmp_path):
    for name in FILES:
        with open(os.path.join(KERAS_TESTS, name)) as f:
            (tmp_path / f"tfdist_{name}").write_text(_ported(f.read()))
    report = tmp_path / "report.xml"
    ini = tmp_path / "pytest.ini"  # this directory's own settings, not the repository's
    ini.write_text("[pytest]\npython_files = tfdist_*.py\n")
    proc = _procs.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(ini), f"--junitxml={report}",
         str(tmp_path)],
        timeout=600,
        env={"KERAS_BACKEND": "tensorflow"},
    )
    cases = ElementTree.parse(report).getroot().iter("testcase")
    outcomes = {}
    for case in cases:
        name = f"{case.get('classname')}.{case.get('name')}"
        problems = [child for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[name] = "passed" if not problems else f"{problems[0].tag}: {problems[0].get('message')}"
    failed = {k: v for k, v in outcomes.items() if v != "passed" and not v.startswith("skipped")}
    assert proc.returncode == 0 and not failed, (failed, proc.stdout[-4000:])
    skips = {v.split(": ", 1)[1] for v in outcomes.values() if v.startswith("skipped")}
    assert skips <= ALLOWED_SKIPS, skips
    passed = [k for k, v in outcomes.items() if v == "passed"]
    # Both files ran, including the case the issue named.
    assert any("OptimizerDistributeTest.test_gradient_accumulation" in k for k in passed), passed
    assert any(k.startswith("tfdist_distribute_test.DistributeTest") for k in passed), passed
    assert len(passed) >= 16, passed

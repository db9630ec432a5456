"""Asserted by tests/cli/test_exit_together.py.

One process of a 2-process job that ends on purpose: how the workers leave together.

    python tests/scenarios/two_process_exit_together.py KIND OUT linger=S heartbeat=H fail=0|1

KIND: "mp" (ModelParallelStrategy on a {"model": 4} mesh over both processes, 2 simulated CPUs each: one
sharded tensor gathered across them) or "mw" (MultiWorkerStrategy: one all-reduce). After its collectives,
the process runs user code for `linger` seconds in an exit hook of its own (registered after the strategy's,
so it runs first, as a user's cleanup does), writing in OUT when it began and ended; fail=1 raises an
uncaught error instead (after writing when).
"""

import atexit
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfdist  # noqa: E402

KIND, OUT = sys.argv[1], sys.argv[2]
OPTS = dict(a.split("=", 1) for a in sys.argv[3:])
HEARTBEAT = float(OPTS.get("heartbeat", 5))
LINGER = float(OPTS.get("linger", 0))
tfdist.simulate_devices(2)
if KIND == "mp":
    strategy = tfdist.ModelParallelStrategy(mesh={"model": 4}, heartbeat_timeout=HEARTBEAT, timeout=60)
else:
    strategy = tfdist.MultiWorkerStrategy(heartbeat_timeout=HEARTBEAT, timeout=60)

import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

if KIND == "mp":
    mesh = strategy.mesh
    split = dtensor.call_with_layout(tf.ones, dtensor.Layout(["model"], mesh), shape=[8])
    whole = dtensor.relayout(split, dtensor.Layout.replicated(mesh, rank=1))
    total = float(tf.reduce_sum(dtensor.unpack(whole)[0]))
    assert total == 8.0, total
else:
    total = strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(lambda: tf.constant(1.0)), axis=None)
    assert float(total) == strategy.num_replicas_in_sync, total


def _write(**times):
    with open(OUT, "w") as f:
        json.dump(times, f)


def _user_cleanup():
    began = time.time()
    time.sleep(LINGER)
    _write(began=began, ended=time.time())


if OPTS.get("fail") == "1":
    _write(began=time.time(), ended=time.time())
    raise RuntimeError("this worker fails on purpose")
atexit.register(_user_cleanup)
print("DONE", flush=True)

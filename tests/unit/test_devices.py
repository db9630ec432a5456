"""tfdist.simulate_devices and device names."""

import pytest

import tfdist
from tfdist import devices


@pytest.mark.parametrize("n", [0, -1, 2.5, "4", True, None, devices.MAX_SIMULATED_DEVICES + 1, 100_000])
def test_simulate_devices_rejects_bad_n(n):
    with pytest.raises(ValueError, match=r"Received: n=.*Expected an integer from 1 to 64\."):
        tfdist.simulate_devices(n)


def test_host_memory_is_the_physical_memory():
    with open("/proc/meminfo") as f:
        total_kib = int(f.readline().split()[1])  # MemTotal: ... kB
    assert devices.host_memory() == pytest.approx(total_kib * 1024, rel=0.01)


def test_simulate_devices_same_count_again_is_a_no_op():
    # conftest already split the CPU into 8 devices and TF has started since.
    names = tfdist.simulate_devices(8)
    assert names == [f"/device:CPU:{i}" for i in range(8)]


def test_simulate_devices_fresh_process(python_subprocess):
    proc = python_subprocess(
        """
        import tfdist
        names = tfdist.simulate_devices(3)
        import tensorflow as tf
        with tf.device(names[2]):
            x = tf.constant(1.0) + 1
        print(len(names), x.device.endswith("CPU:2"))
        try:
            tfdist.simulate_devices(5)
        except RuntimeError as e:
            print("ERROR", e)
        """
    )
    assert proc.returncode == 0, proc.stderr
    first, error = proc.stdout.strip().splitlines()
    assert first == "3 True"
    assert "simulate_devices(5) was called after TensorFlow initialized its runtime with 3" in error
    assert "Call tfdist.simulate_devices(5) first" in error


def test_simulate_devices_after_tf_started(python_subprocess):
    proc = python_subprocess(
        """
        import tensorflow as tf
        tf.constant(1.0) * 2
        import tfdist
        tfdist.simulate_devices(2)
        """
    )
    assert proc.returncode != 0
    assert "RuntimeError: simulate_devices(2) was called after TensorFlow initialized" in proc.stderr
    assert "with 1 logical CPU device(s)" in proc.stderr


def test_canonical_device_short_forms():
    assert devices.canonical_device("CPU:3") == "/device:CPU:3"
    assert devices.canonical_device("/cpu:0") == "/device:CPU:0"
    assert devices.canonical_device("/job:localhost/replica:0/task:0/device:CPU:7").endswith("CPU:7")


def test_canonical_device_unknown_names_the_choices():
    with pytest.raises(ValueError, match=r"'CPU:99' does not exist.*CPU:7"):
        devices.canonical_device("CPU:99")


def test_default_devices_are_all_logical_cpus_without_gpus():
    assert devices.default_devices() == [f"/device:CPU:{i}" for i in range(8)]

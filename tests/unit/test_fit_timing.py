"""tfdist._fit_timing: step times from batch ends inside `fit`, models compared in interleaved rounds."""

import time

import pytest

from tfdist import _fit_timing

WARMUP_S = 0.4  # each warm-up step (as tracing is): in no step time
FAST_S, SLOW_S = 0.02, 0.06


class Sleeper:
    """A stand-in for a Keras model whose `fit` steps take known times, and which logs its calls."""

    def __init__(self, name: str, seconds: float, calls: list):
        self.name, self.seconds, self.calls = name, seconds, calls

    def fit(self, dataset, *, epochs, steps_per_epoch, verbose, shuffle, callbacks):
        self.calls.append((self.name, steps_per_epoch))
        for step in range(steps_per_epoch):
            time.sleep(WARMUP_S if step < 2 else self.seconds)
            for callback in callbacks:
                callback.on_train_batch_end(step)


def test_rounds_alternate_and_the_warm_up_is_left_out():
    calls = []
    models = {"fast": Sleeper("fast", FAST_S, calls), "slow": Sleeper("slow", SLOW_S, calls)}
    times = _fit_timing.interleaved_step_times(models, None, rounds=3, steps=2, warmup=2)
    # Each round runs every model once, 2 warm-up + 2 timed steps, the order rotating from round to round.
    assert calls == [("fast", 4), ("slow", 4), ("slow", 4), ("fast", 4), ("fast", 4), ("slow", 4)]
    # Half of each fit's intervals would be warm-up ones if they were kept: the medians would be near WARMUP_S.
    # Each model's own steps, told apart: sleeps overshoot on a busy host, but not by 20 ms at the median.
    assert FAST_S <= times["fast"] < (FAST_S + SLOW_S) / 2 <= times["slow"] < WARMUP_S / 4, times


@pytest.mark.parametrize("name", ["rounds", "steps", "warmup"])
def test_counts_below_one_are_refused_naming_them(name):
    counts = {"rounds": 1, "steps": 1, "warmup": 1, name: 0}
    with pytest.raises(ValueError, match=rf"argument `{name}` of interleaved_step_times\(\)\. Received: {name}=0"):
        _fit_timing.interleaved_step_times({}, None, **counts)

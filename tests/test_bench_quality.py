"""bench_quality's final row compares the three arms at equal training."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_quality import equal_step_losses  # noqa: E402


def test_equal_step_losses_takes_the_last_step_every_arm_reached():
    # the DSV arm stopped at 1692 by its minutes budget; its last value must not be set against 2000-step runs
    curves = {"full": [(250, 1.4), (1500, 1.03), (1750, 0.96), (2000, 0.955)],
              "dsv": [(250, 1.5), (1500, 1.015), (1692, 0.978)],
              "window": [(250, 1.44), (1500, 1.01), (1750, 0.94), (2000, 0.96)]}
    step, val = equal_step_losses(curves)
    assert step == 1500 and val == {"full": 1.03, "dsv": 1.015, "window": 1.01}
    same = {a: [(250, 1.0), (500, v)] for a, v in (("full", 0.9), ("dsv", 0.8), ("window", 0.7))}
    assert equal_step_losses(same) == (500, {"full": 0.9, "dsv": 0.8, "window": 0.7})


def test_equal_step_losses_without_a_shared_step_names_the_fix():
    with pytest.raises(ValueError, match="minutes"):
        equal_step_losses({"full": [(250, 1.0)], "dsv": [(100, 1.1)], "window": [(250, 1.2)]})
    with pytest.raises(ValueError, match="`curves` is empty"):
        equal_step_losses({})

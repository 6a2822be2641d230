"""The result tables' derived figures."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from disagg.core.metrics import host_share


def test_host_share_counts_only_the_passes_whose_device_time_was_measured() -> None:
    """Wall time outside the device span, over the timed passes only: 2 of 10 ms here (the
    untimed pass is left out); NaN when nothing was timed or the column predates device_s."""
    steps = pd.DataFrame({"duration_s": [0.004, 0.006, 0.05], "device_s": [0.003, 0.005, math.nan]})
    assert host_share(steps) == pytest.approx(0.2)
    assert math.isnan(host_share(steps.iloc[2:]))
    assert math.isnan(host_share(steps.drop(columns="device_s")))

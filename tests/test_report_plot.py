"""The loss PNG: written, a real PNG of sensible size, abandoned branches greyed, non-finite values survived."""

from __future__ import annotations

import math

import matplotlib.colors as mcolors
import matplotlib.image as mpimg
import numpy as np
import pytest

from supervisor.report import ABANDONED_COLOR, plot_lineage
from supervisor.report.plot import y_scale
from tests.test_report_timeline import lineage_points, lineage_record

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _grey_pixels(path) -> int:
    """Pixels within 3/255 of the abandoned-branch colour (antialiased text and lines never land there)."""
    rgb = mpimg.imread(path)[..., :3]
    return int((np.abs(rgb - np.array(mcolors.to_rgb(ABANDONED_COLOR))) <= 3 / 255).all(axis=-1).sum())


def _check_png(path) -> np.ndarray:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert 10_000 < len(data) < 2_000_000
    image = mpimg.imread(path)
    assert image.shape[0] >= 400 and image.shape[1] >= 800
    return image


def test_sample_lineage_plot_has_grey_abandoned_branches(tmp_path):
    points, _ = lineage_points()
    out = plot_lineage(lineage_record(), points, tmp_path / "sub" / "loss.png")
    assert out == tmp_path / "sub" / "loss.png"
    _check_png(out)
    assert _grey_pixels(out) > 200


def test_a_lineage_without_rollbacks_has_no_grey(tmp_path):
    # One segment stopped on a plateau: an event is marked but no branch is abandoned.
    record = {
        "lineage": "calm",
        "status": "stopped",
        "segments": [
            {
                "index": 0,
                "outcome": "stop",
                "event": {
                    "type": "plateau",
                    "step": 150,
                    "onset_step": 150,
                    "source": "monitor",
                    "reason": "flat",
                },
                "decision": {
                    "action": "stop",
                    "target_id": "0000000100-000001",
                    "target_step": 100,
                    "reason": "stop",
                },
            }
        ],
    }
    points = {
        "loss": [(s, 3.0 / (s + 1) + 0.5, 1000 + 100 * s) for s in range(1, 151)],
        "val_loss": [(s, 3.0 / (s + 1) + 0.6, 1001 + 100 * s) for s in range(50, 151, 50)],
    }
    out = plot_lineage(record, points, tmp_path / "calm.png")
    _check_png(out)
    assert _grey_pixels(out) == 0


@pytest.mark.parametrize(
    "bad",
    [math.nan, math.inf, -math.inf],
    ids=["nan", "inf", "-inf"],
)
def test_non_finite_values_do_not_break_the_plot(tmp_path, bad):
    points, _ = lineage_points()
    points["loss"] = [(s, bad if s in (150, 151, 600) else v, t) for s, v, t in points["loss"]]
    points["val_loss"].append((600, bad, points["val_loss"][-1][2] + 5))
    out = plot_lineage(lineage_record(), points, tmp_path / "bad.png")
    _check_png(out)
    assert _grey_pixels(out) > 200


def test_huge_spike_and_empty_points_still_give_a_png(tmp_path):
    points, _ = lineage_points()
    points["loss"] = [(s, 1e6 if 398 <= s <= 412 and v > 2 else v, t) for s, v, t in points["loss"]]
    _check_png(plot_lineage(lineage_record(), points, tmp_path / "spike.png"))
    empty = plot_lineage({"lineage": "none", "status": "running", "segments": []}, {}, tmp_path / "empty.png")
    assert empty.read_bytes()[:8] == PNG_MAGIC and _grey_pixels(empty) == 0


@pytest.mark.parametrize(
    ("values", "scale"),
    [
        ([], "linear"),
        ([1.0, 50.0], "linear"),
        ([1.0, 100.0], "linear"),
        ([1.0, 1000.0], "log"),
        ([0.01, 2.0], "log"),
        ([-1.0, 1000.0], "linear"),  # log cannot show a negative loss
        ([0.0, 1000.0], "linear"),
        ([1.0, math.nan, math.inf, 2.0], "linear"),  # non-finite values do not count
    ],
)
def test_y_scale(values, scale):
    assert y_scale(values) == scale

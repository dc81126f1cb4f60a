"""The rows a device's statistics are made of (closed_form/projection.py::prepare): unit
length after the fleet's projection, so that a noisy sum's signal uses the whole clip
budget its sensitivity is priced at (issue 56)."""

from __future__ import annotations

import numpy as np
import pytest

from closed_form.projection import prepare, projection
from edge_agent.closed_form import ClosedFormDevice
from edge_agent.config import ClosedFormSettings
from edge_agent.methods import device_method
from fleet.transports.spec import FLEET


def test_a_projected_row_is_scaled_back_to_unit_length() -> None:
    # [3, 4] / 5 = [0.6, 0.8]; the first axis keeps 0.6, which becomes 1: the row the
    # sensitivity bound allows (norm 1), not 0.6 of it.
    q = np.array([[1.0], [0.0]])
    np.testing.assert_array_equal(prepare([[3.0, 4.0], [0.0, 2.0]], q), [[1.0], [0.0]])
    # Without a projection the rows are only made unit length; a zero row stays zero.
    np.testing.assert_array_equal(
        prepare([[0.0, -2.0], [0.0, 0.0]], None), [[0.0, -1.0], [0.0, 0.0]]
    )


def test_the_fleets_projection_leaves_every_row_at_unit_length() -> None:
    rng = np.random.default_rng(3)
    rows = prepare(rng.normal(size=(50, 96)) + 0.3, projection(FLEET, 96, 16))
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, rtol=1e-14)


def test_a_devices_second_moment_spends_the_whole_budget_its_noise_is_priced_for() -> None:
    """trace(G) is the sum of the rows' squared norms: one per example at unit length,
    the most the sensitivity (closed_form/privacy.py) allows. Rows left at the length the
    projection gives them, about sqrt(k / D), made it k / D of that (a sixth here, 0.07
    at k 64 of the zoo's 896 features), against the same noise."""
    rng = np.random.default_rng(4)
    device = ClosedFormDevice(
        method=device_method("lda"), fleet=FLEET, features=rng.normal(size=(40, 96)) + 0.5,
        labels=rng.integers(0, 10, size=40), num_classes=10,
        settings=ClosedFormSettings(dim=16), seed=0, state_dir=None,
    )  # fmt: skip
    stats = device.statistics()
    assert stats.gram is not None
    assert np.trace(stats.gram) == pytest.approx(40.0, rel=1e-12)

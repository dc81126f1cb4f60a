"""A device's personalised head: its own ridge pulled toward the global head."""

import numpy as np

from closed_form.heads import LinearHead, lda_head
from closed_form.personal import centred, personalised_head
from closed_form.statistics import clip_rows, device_statistics

PK, PC = 6, 3


def _population(seed: int) -> tuple[np.random.Generator, np.ndarray, LinearHead]:
    rng = np.random.default_rng(seed)
    centres = np.eye(PK)[:PC] * 0.6
    y = rng.integers(0, PC, 600)
    x = clip_rows(centres[y] + rng.normal(size=(600, PK)) * 0.25)
    return rng, centres, lda_head(device_statistics(x, y, PC))


def _device_rows(
    rng: np.random.Generator, centres: np.ndarray, n: int, swap: bool
) -> tuple[np.ndarray, np.ndarray]:
    y = rng.integers(0, PC, n)
    x = clip_rows(centres[y] + rng.normal(size=(n, PK)) * 0.25)
    if swap:  # this device calls class 0 "1" and class 1 "0"
        y = np.array([1, 0, 2])[y]
    return x, y


def test_personalised_head_with_huge_lambda_predicts_as_the_global_head() -> None:
    rng, centres, global_head = _population(12)
    x, y = _device_rows(rng, centres, 40, swap=False)
    head = personalised_head(x, y, global_head, lam=1e12)
    test_x, _ = _device_rows(rng, centres, 1000, swap=False)
    np.testing.assert_array_equal(head.predict(test_x), global_head.predict(test_x))
    np.testing.assert_array_equal(head.present, global_head.present)


def test_personalised_head_with_tiny_lambda_fits_the_devices_own_labelling() -> None:
    rng, centres, global_head = _population(13)
    x, y = _device_rows(rng, centres, 200, swap=True)
    head = personalised_head(x, y, global_head, lam=1e-6)
    test_x, test_y = _device_rows(rng, centres, 1000, swap=True)
    own = float(np.mean(head.predict(test_x) == test_y))
    global_acc = float(np.mean(global_head.predict(test_x) == test_y))
    assert own > 0.85
    assert global_acc < 0.5
    assert float(np.mean(head.predict(x) == y)) > float(np.mean(global_head.predict(x) == y))


def test_personalised_head_of_one_row_keeps_the_global_scale() -> None:
    rng, centres, global_head = _population(14)
    x, y = _device_rows(rng, centres, 1, swap=False)
    head = personalised_head(x, y, global_head, lam=1e12)
    # one row cannot fit a and b: a = 1, b = 0, so the head tends to the global one itself
    # (centred over its classes: the same predictions)
    weight, bias = centred(global_head)
    np.testing.assert_allclose(head.weight, weight, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(head.bias, bias, rtol=1e-6, atol=1e-6)


def test_a_global_heads_common_offset_does_not_pull_the_personalised_head_off() -> None:
    # An LDA's scores share an offset far above their spread between classes (digits-5:
    # 450-700, against a spread of a few units). The same head with every class's scores
    # shifted alike predicts the same, and must personalise the same; before the head was
    # centred, the shift dragged the personalised head to 0.12-0.20 on a device's held-out
    # rows while the fleet's scored 0.92-1.0.
    rng, centres, global_head = _population(15)
    x, y = _device_rows(rng, centres, 40, swap=False)
    shifted = LinearHead(weight=global_head.weight + 300.0, bias=global_head.bias + 500.0,
                         present=global_head.present)  # fmt: skip
    test_x, test_y = _device_rows(rng, centres, 1000, swap=False)
    np.testing.assert_array_equal(shifted.predict(test_x), global_head.predict(test_x))
    plain = personalised_head(x, y, global_head, lam=1.0)
    moved = personalised_head(x, y, shifted, lam=1.0)
    np.testing.assert_allclose(moved.weight, plain.weight, rtol=1e-9, atol=1e-9)
    fleet_acc = float(np.mean(global_head.predict(test_x) == test_y))
    assert float(np.mean(moved.predict(test_x) == test_y)) >= fleet_acc - 0.05


def test_personalised_head_with_huge_lambda_is_the_global_head_on_the_target_scale() -> None:
    rng, centres, global_head = _population(15)
    x, y = _device_rows(rng, centres, 60, swap=False)
    head = personalised_head(x, y, global_head, lam=1e12)
    # LDA scores are log-odds (centred over the classes); one-hot targets are 0/1: the
    # fitted line a L + b, a < 1
    weight, bias = centred(global_head)
    scores = LinearHead(weight=weight, bias=bias, present=global_head.present).scores
    a, b = np.polyfit(scores(x).ravel(), np.eye(PC)[y].ravel(), 1)
    assert 0.0 < a < 1.0
    test_x, _ = _device_rows(rng, centres, 200, swap=False)
    np.testing.assert_allclose(head.scores(test_x), a * scores(test_x) + b, rtol=1e-6, atol=1e-6)

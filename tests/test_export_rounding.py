"""Error-compensating rounding of int8 weights (GPTQ with the bias as a free column),
on hand-sized cases where nearest rounding's error is known."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from torch import nn

from export import quantize
from export.onnx_io import export_onnx
from export.rounding import ConvInput, Hessians, round_rows


def test_uncorrelated_inputs_round_to_nearest_and_keep_the_bias():
    weights = np.array([[0.4, -1.6, 2.5, 0.25], [3.3, 0.49, -0.51, -1.0]])  # last: bias
    q, bias = round_rows(weights, np.array([1.0, 1.0]), np.eye(4), qmin=-127, qmax=127)
    np.testing.assert_array_equal(q, [[0, -2, 2], [3, 0, -1]])  # numpy rounds half to even
    np.testing.assert_allclose(bias, [0.25, -1.0])


def test_a_constant_input_moves_the_rounding_error_into_the_bias():
    # Input always 2: the weight 0.3 rounds to 0 and loses 0.6 of output, which the
    # bias takes back (H = [[4, 2], [2, 1]], damped by 1% of its mean diagonal: 0.585).
    hessian = np.array([[4.0, 2.0], [2.0, 1.0]])
    q, bias = round_rows(np.array([[0.3, 0.0]]), np.array([1.0]), hessian, qmin=-127, qmax=127)
    assert q[0, 0] == 0
    assert bias[0] == pytest.approx(0.3 * 2 / 1.025)


def test_a_flat_patch_keeps_its_response_where_nearest_rounding_loses_it():
    # A 3-tap edge filter whose taps nearly cancel, as EfficientNet's depthwise ones do:
    # on a flat input of level L nearest rounding (-2, 0, 2) answers 0 instead of 0.1 L.
    rng = np.random.default_rng(0)
    level = rng.uniform(0, 6, size=(4000, 1))
    patches = level + 0.05 * rng.standard_normal((4000, 3))  # nearly flat patches
    rows = np.concatenate([patches, np.ones((4000, 1))], axis=1)
    hessian = rows.T @ rows / len(rows)
    weights = np.array([[-2.4, 0.0, 2.5, 0.0]])
    nearest = np.round(weights[0, :3])
    q, bias = round_rows(weights, np.array([1.0]), hessian, qmin=-127, qmax=127)
    exact = patches @ weights[0, :3]
    err_nearest = np.mean((patches @ nearest - exact) ** 2)
    err_gptq = np.mean((patches @ q[0] + bias[0] - exact) ** 2)
    assert err_nearest > 0.1  # E[(0.1 L)^2] for L uniform in [0, 6]: 0.12
    assert err_gptq < err_nearest / 3


def test_seven_bit_levels_are_kept():
    q, _ = round_rows(
        np.array([[100.0, -90.0, 0.0]]), np.array([1.0]), np.eye(3), qmin=-64, qmax=64
    )
    np.testing.assert_array_equal(q, [[64, -64]])


def test_depthwise_hessians_are_per_channel_and_sampled_from_padded_patches():
    conv = ConvInput(
        node="dw", tensor="x", kernel=(3, 3), stride=(2, 2), pads=(0, 0, 1, 1), group=2
    )
    hessians = Hessians([conv], positions=10_000)
    x = np.zeros((1, 2, 4, 4), dtype=np.float32)
    x[0, 1] = 1.0  # channel 1 is all ones, channel 0 all zeros
    hessians.add("dw", x)
    h = hessians.get("dw")
    assert h is not None and h.shape == (2, 10, 10)
    np.testing.assert_allclose(h[0, :9, :9], 0)
    # Output positions (0, 0), (0, 1), (1, 0), (1, 1); the pad after reaches the last
    # row and column of taps at output 1, so tap (2, 2) sees a one only at output (0, 0).
    assert h[1, 8, 8] == pytest.approx(1 / 4)
    assert h[1, 0, 0] == pytest.approx(1.0)
    assert h[1, 9, 9] == pytest.approx(1.0)  # the bias input


@pytest.mark.slow
def test_int8_export_keeps_depthwise_weights_8_bit_and_the_rest_7_bit(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),  # stem: a matrix product, saturates on AVX2
        nn.ReLU6(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8),  # depthwise: widened, cannot saturate
        nn.ReLU6(),
        nn.Conv2d(8, 16, 1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    ).eval()
    export_onnx(model, tmp_path / "m.onnx", input_shape=(3, 12, 12))
    calibration = np.random.default_rng(0).uniform(-1, 1, (16, 3, 12, 12)).astype(np.float32)
    quantize.to_int8(
        tmp_path / "m.onnx", tmp_path / "q.onnx", calibration=calibration, seven_bit_weights=True
    )
    q = onnx.load(str(tmp_path / "q.onnx"))
    weights = {
        tuple(t.dims): numpy_helper.to_array(t)
        for t in q.graph.initializer
        if t.data_type == onnx.TensorProto.INT8 and len(t.dims) == 4
    }
    assert np.abs(weights[(8, 3, 3, 3)]).max() <= 64
    assert np.abs(weights[(16, 8, 1, 1)]).max() <= 64
    assert np.abs(weights[(8, 1, 3, 3)]).max() > 64  # each channel's largest tap at 127

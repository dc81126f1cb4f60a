"""Error-compensating rounding of a quantized model's convolution weights.

Rounding every int8 weight to its nearest level is what ONNX Runtime's quantizer does, and
for EfficientNet-Lite it is the larger part of the int8 error: a 3x3 depthwise filter is
an edge detector whose taps nearly cancel, so on a flat patch (a rendered glyph's
background, a clear sky) its response is the sum of nine rounding errors and no longer
near zero. Here the levels are chosen instead one input column at a time, each column's
rounding error pushed onto the columns not yet rounded, in proportion to how the
calibration inputs correlate with them (GPTQ, Frantar et al. 2023, Algorithm 1, with the
Hessian H = E[x x^T] of each convolution's input patches). The bias rides along as one
more column whose input is the constant 1; it is never rounded to int8, so it absorbs
what the weights leave over, which is the classic bias correction of the mean error.

The scales, zero points and weight dtypes the quantizer chose are kept: only the integer
values of the weights and of the int32 biases change, so the kernels are the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

#: Added to the Hessian's diagonal, as a fraction of its mean, so that it can be inverted
#: when some inputs never vary (a dead channel); the GPTQ paper's 1%.
DAMPING = 0.01


@dataclass(frozen=True)
class ConvInput:
    """What rounding needs to know of one Conv of the float model."""

    node: str
    tensor: str  # its input activation
    kernel: tuple[int, int]
    stride: tuple[int, int]
    pads: tuple[int, int, int, int]  # top, left, bottom, right
    group: int


def _ints(node: onnx.NodeProto, name: str, default: list[int]) -> list[int]:
    attr = next((a for a in node.attribute if a.name == name), None)
    return list(attr.ints) if attr is not None else default


def conv_inputs(model: onnx.ModelProto) -> list[ConvInput]:
    """Every Conv of ``model`` with a constant 2-D weight, by node name."""
    shapes = {t.name: tuple(t.dims) for t in model.graph.initializer}
    out = []
    for node in model.graph.node:
        if node.op_type != "Conv" or len(shapes.get(node.input[1], ())) != 4:
            continue
        kh, kw = shapes[node.input[1]][2:]
        group = next((a.i for a in node.attribute if a.name == "group"), 1)
        pads = _ints(node, "pads", [0, 0, 0, 0])
        stride = _ints(node, "strides", [1, 1])
        out.append(
            ConvInput(
                node=node.name,
                tensor=node.input[0],
                kernel=(kh, kw),
                stride=(stride[0], stride[1]),
                pads=(pads[0], pads[1], pads[2], pads[3]),
                group=group,
            )
        )
    return out


def _patches(x: np.ndarray, conv: ConvInput, rng: np.random.Generator, count: int) -> np.ndarray:
    """The (C, S, kh*kw) input patches of ``count`` output positions of ``x``
    (N, C, H, W) drawn at random (all of them when there are fewer)."""
    kh, kw = conv.kernel
    sh, sw = conv.stride
    top, left, bottom, right = conv.pads
    if top or left or bottom or right:
        x = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
    n, _, h, w = x.shape
    oh, ow = (h - kh) // sh + 1, (w - kw) // sw + 1
    total = n * oh * ow
    picks = np.arange(total) if total <= count else np.sort(rng.choice(total, count, False))
    b, rest = np.divmod(picks, oh * ow)
    oy, ox = np.divmod(rest, ow)
    taps = [x[b, :, oy * sh + i, ox * sw + j] for i in range(kh) for j in range(kw)]  # (S, C)
    return np.stack(taps, axis=2).transpose(1, 0, 2)


def _augmented(block: np.ndarray) -> np.ndarray:
    """Rows of inputs with the constant 1 of the bias appended: (P, K + 1)."""
    return np.concatenate([block, np.ones((len(block), 1), dtype=block.dtype)], axis=1)


class Hessians:
    """Running E[x x^T] of every Conv's (bias-augmented) input patches; a grouped
    (depthwise) Conv gets one per channel, since each channel sees only its own input."""

    def __init__(self, convs: list[ConvInput], *, positions: int = 2048, seed: int = 0) -> None:
        self.convs = {c.node: c for c in convs}
        self.positions = positions  # sampled per batch: a few thousand rows pin H down
        self.rng = np.random.default_rng(seed)
        self.sums: dict[str, np.ndarray] = {}
        self.counts: dict[str, int] = {}

    def add(self, node: str, x: np.ndarray) -> None:
        """Accumulate one batch of ``node``'s input activations (N, C, H, W)."""
        conv = self.convs[node]
        # A depthwise channel's Hessian is only (k+1)^2: a few hundred positions a batch do.
        count = self.positions if conv.group == 1 else self.positions // 8
        patches = _patches(x.astype(np.float32), conv, self.rng, count)  # (C, P, k)
        c, p, k = patches.shape
        if conv.group == 1:
            rows = _augmented(patches.transpose(1, 0, 2).reshape(p, c * k).astype(np.float64))
            gram = rows.T @ rows  # (C*k + 1, C*k + 1), column order (channel, kh, kw)
        elif conv.group == c:
            ones = np.ones((c, p, 1), dtype=np.float64)
            rows = np.concatenate([patches.astype(np.float64), ones], axis=2)
            gram = np.ascontiguousarray(rows.transpose(0, 2, 1)) @ rows  # (C, k + 1, k + 1)
        else:
            return  # grouped but not depthwise: left to nearest rounding
        # float64: float32 products of near-dead channels' tiny values go subnormal, slowly
        self.sums[node] = self.sums.get(node, 0) + gram
        self.counts[node] = self.counts.get(node, 0) + p

    def get(self, node: str) -> np.ndarray | None:
        if node not in self.sums:
            return None
        return self.sums[node] / self.counts[node]


def round_rows(
    weights: np.ndarray, scales: np.ndarray, hessian: np.ndarray, *, qmin: int, qmax: int
) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ rounding of ``weights`` (R, K) with per-row ``scales`` (R,), the last column
    being the bias (input 1, left in float): returns (integer weights (R, K-1), new bias
    (R,)). ``hessian`` is (K, K), or (R, K, K) for one per row."""
    w = weights.astype(np.float64).copy()
    r, k = w.shape
    h = hessian[None] if hessian.ndim == 2 else hessian  # (1 or R, K, K)
    damp = DAMPING * np.mean(np.diagonal(h, axis1=1, axis2=2), axis=1)
    h = h + damp[:, None, None] * np.eye(k)
    # Upper Cholesky factor of H^-1: row j holds how column j's error spreads to j+1..
    upper = np.linalg.cholesky(np.linalg.inv(h)).transpose(0, 2, 1)
    q = np.zeros((r, k - 1), dtype=np.float64)
    for j in range(k - 1):
        q[:, j] = np.clip(np.round(w[:, j] / scales), qmin, qmax)
        err = (w[:, j] - q[:, j] * scales) / upper[:, j, j]
        w[:, j + 1 :] -= err[:, None] * upper[:, j, j + 1 :]
    return q, w[:, -1]


def _dequantize_of(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {n.output[0]: n for n in model.graph.node if n.op_type == "DequantizeLinear"}


def _levels(dtype: np.dtype, values: np.ndarray) -> tuple[int, int]:
    """The integer range the quantizer used: 7-bit weights ([-64, 64]) stay 7-bit."""
    if dtype == np.uint8:
        return 0, 255
    return (-64, 64) if np.abs(values).max() <= 64 else (-127, 127)


def apply(
    quantized: onnx.ModelProto,
    float_model: onnx.ModelProto,
    hessians: Hessians,
) -> int:
    """Rewrite the int8 weights and int32 biases of ``quantized`` (a QDQ model made from
    ``float_model``) by :func:`round_rows`; returns how many Convs were rounded."""
    floats = {t.name: numpy_helper.to_array(t) for t in float_model.graph.initializer}
    float_convs = {n.name: n for n in float_model.graph.node if n.op_type == "Conv"}
    inits = {t.name: t for t in quantized.graph.initializer}
    dq = _dequantize_of(quantized)
    done = 0
    for node in quantized.graph.node:
        if node.op_type != "Conv" or node.name not in float_convs:
            continue
        h = hessians.get(node.name)
        source = float_convs[node.name]
        w_dq, b_dq = dq.get(node.input[1]), dq.get(node.input[2]) if len(node.input) > 2 else None
        if h is None or w_dq is None or b_dq is None or source.input[1] not in floats:
            continue
        w_float = floats[source.input[1]].astype(np.float64)  # (O, I, kh, kw)
        b_float = floats[source.input[2]].astype(np.float64) if len(source.input) > 2 else 0.0
        w_int = inits[w_dq.input[0]]
        current = numpy_helper.to_array(w_int)
        zero = numpy_helper.to_array(inits[w_dq.input[2]]) if len(w_dq.input) > 2 else 0
        if np.any(zero != 0):
            continue  # asymmetric weights: the column update assumes zero points of 0
        scales = numpy_helper.to_array(inits[w_dq.input[1]]).astype(np.float64)
        scales = np.broadcast_to(scales, (len(w_float),))
        qmin, qmax = _levels(current.dtype, current)
        rows = np.concatenate(
            [w_float.reshape(len(w_float), -1), np.broadcast_to(b_float, (len(w_float),))[:, None]],
            axis=1,
        )
        q, bias = round_rows(rows, scales, h, qmin=qmin, qmax=qmax)
        w_int.CopyFrom(
            numpy_helper.from_array(q.reshape(current.shape).astype(current.dtype), w_int.name)
        )
        b_int = inits[b_dq.input[0]]
        b_scale = numpy_helper.to_array(inits[b_dq.input[1]]).astype(np.float64)
        info = np.iinfo(np.int32)
        b_new = np.clip(np.round(bias / b_scale), info.min, info.max).astype(np.int32)
        b_int.CopyFrom(numpy_helper.from_array(b_new, b_int.name))
        done += 1
    return done


def batches(samples: np.ndarray, size: int) -> Iterator[np.ndarray]:
    for i in range(0, len(samples), size):
        yield samples[i : i + size]


def collect(
    float_model: onnx.ModelProto, samples: np.ndarray, *, input_name: str, batch: int = 8
) -> Hessians:
    """Run ``float_model`` on ``samples`` and accumulate every Conv's input Hessian."""
    import onnxruntime as ort

    convs = conv_inputs(float_model)
    probe = onnx.ModelProto()
    probe.CopyFrom(float_model)
    graph_outputs = {o.name for o in probe.graph.output}
    tensors = sorted({c.tensor for c in convs})
    for name in tensors:
        if name not in graph_outputs and name != input_name:
            probe.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    # Idle ONNX Runtime threads spinning between batches slow the numpy work between them.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(
        probe.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    hessians = Hessians(convs)
    for x in batches(samples.astype(np.float32), batch):
        fetch = [t for t in tensors if t != input_name]
        values = dict(zip(fetch, session.run(fetch, {input_name: x}), strict=True))
        values[input_name] = x
        for conv in convs:
            hessians.add(conv.node, values[conv.tensor])
    return hessians

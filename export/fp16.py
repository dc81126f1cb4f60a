"""Which layers of a backbone fp16 can hold, measured on real inputs before converting.

fp16 keeps about three significant digits between 6.1e-5 (its smallest normal number)
and 65504 (its largest). A layer whose activations leave that range on real inputs
breaks in fp16 on a GPU, where each operator computes in fp16, but not on ONNX Runtime's
CPU provider, which runs an fp16 graph in fp32 between casts: a randomly initialised
EfficientNet-Lite0 agrees with fp32 to a cosine of 0.9999998 there and gave 0.283 on
CUDA. Its activations shrink with every layer (PyTorch's default initialisation scales a
convolution's output by about 1/sqrt(3), and an untrained BatchNorm does not rescale):
from the second block on, the typical activation is below 6.1e-5, and by the head
convolution it is about 1e-8, under fp16's smallest subnormal (6e-8), so fp16 flushes it
to zero. The fp32 model itself, run once on the calibration images, shows this, on any
machine: :func:`out_of_range` names the nodes whose outputs leave fp16's range, the
conversion keeps those nodes (and the nodes that read their outputs) in fp32, and a
backbone for which that would be most of the graph is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from export.bundle import INPUT_NAME
from export.errors import ExportError

#: Largest magnitude left to an fp16 activation: a quarter of fp16's maximum, so that
#: the next operator's sums of such values still fit.
FP16_LARGEST = 65504.0 / 4
#: fp16's smallest normal number: below it, values lose precision bit by bit.
FP16_SMALLEST_NORMAL = 2.0**-14
#: Keeping more than this share of a graph's weighted layers in fp32 means fp16 does not
#: suit it: the file would be fp16 in name only.
MAX_FP32_SHARE = 0.5
#: The operators that hold a backbone's weights and its time.
WEIGHTED = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})


@dataclass(frozen=True)
class OutOfRange:
    node: str
    output: str
    largest: float  # max |x| over the samples
    typical: float  # median |x| of the nonzero values

    def why(self) -> str:
        if self.largest > FP16_LARGEST:
            return f"{self.node}: activations up to {self.largest:.3g} (fp16 overflows at 65504)"
        return (
            f"{self.node}: typical activation {self.typical:.3g}, below fp16's normal range "
            f"({FP16_SMALLEST_NORMAL:.2g}; it flushes below 6e-8)"
        )


def name_nodes(model: onnx.ModelProto) -> None:
    """Give every node a unique name: the converter keeps nodes in fp32 by name."""
    seen: set[str] = set()
    for i, node in enumerate(model.graph.node):
        if not node.name or node.name in seen:
            node.name = f"{node.op_type}_{i}"
        seen.add(node.name)


def out_of_range(model: onnx.ModelProto, samples: np.ndarray) -> list[OutOfRange]:
    """Every node whose float output, on ``samples`` (preprocessed (N, C, H, W) inputs),
    leaves fp16's range. ``model`` is fp32 with named nodes."""
    import onnxruntime as ort

    inferred = onnx.shape_inference.infer_shapes(model)
    floats = {
        v.name
        for v in [*inferred.graph.value_info, *inferred.graph.output]
        if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    }
    probe = onnx.ModelProto()
    probe.CopyFrom(inferred)
    present = {o.name for o in probe.graph.output}
    for v in inferred.graph.value_info:
        if v.name in floats and v.name not in present:
            probe.graph.output.append(v)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    # No graph optimisation: fusing would drop the very tensors being measured.
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        probe.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in session.get_outputs()]
    values = dict(zip(names, session.run(names, {INPUT_NAME: samples}), strict=True))
    # Constants are stored, not computed: the converter rounds them into range (a
    # normalisation's epsilon of 1e-12 becomes 6e-8, which changes nothing).
    producer = {
        out: node.name
        for node in model.graph.node
        if node.op_type != "Constant"
        for out in node.output
    }
    found = []
    for name in names:
        if name not in producer or name not in floats:
            continue
        magnitude = np.abs(values[name].astype(np.float64)).ravel()
        nonzero = magnitude[magnitude > 0]
        if not nonzero.size:
            continue
        largest, typical = float(nonzero.max()), float(np.median(nonzero))
        if largest > FP16_LARGEST or typical < FP16_SMALLEST_NORMAL:
            found.append(OutOfRange(producer[name], name, largest, typical))
    return found


def fp32_nodes(model: onnx.ModelProto, found: list[OutOfRange]) -> list[str]:
    """The nodes to keep in fp32: those producing an out-of-range value and those that
    read one (an fp16 reader would get the value cast to fp16, and break the same way)."""
    bad_values = {f.output for f in found}
    keep = {f.node for f in found}
    keep |= {n.name for n in model.graph.node if bad_values.intersection(n.input)}
    return [n.name for n in model.graph.node if n.name in keep]


def check_share(model: onnx.ModelProto, keep: list[str], found: list[OutOfRange]) -> None:
    """Refuse fp16 for a backbone most of whose weighted layers would stay in fp32."""
    weighted = [n.name for n in model.graph.node if n.op_type in WEIGHTED]
    kept = set(keep).intersection(weighted)
    total = len(weighted)
    if total and len(kept) / total > MAX_FP32_SHARE:
        worst = min(found, key=lambda f: f.typical) if found else None
        example = f" (e.g. {worst.why()})" if worst is not None else ""
        raise ExportError(
            f"fp16 does not suit this backbone: {len(kept)} of its {total} weighted layers compute "
            f"outside fp16's range on the sample images{example}; build it in fp32"
        )

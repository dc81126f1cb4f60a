"""fp16 conversion and int8 static QDQ quantization of an fp32 backbone, with the quality
report the bundle records: feature cosine similarity against fp32 and the agreement of
nearest-prototype predictions."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Literal

import numpy as np
import onnx

from export import fp16, rounding
from export.bundle import INPUT_NAME

Precision = Literal["fp32", "fp16", "int8"]


def to_fp16(src: Path, dst: Path, *, samples: np.ndarray | None = None) -> list[str]:
    """Convert ``src`` to fp16 at ``dst``; returns the nodes kept in fp32.

    With ``samples`` (preprocessed inputs, a few real images), the fp32 model runs on them
    first, and nodes whose activations leave fp16's range stay in fp32; a backbone for
    which that would be most of the graph is refused with an ``ExportError``
    (:mod:`export.fp16` says why a CPU-only check cannot see this)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(str(src))
    keep: list[str] = []
    if samples is not None:
        fp16.name_nodes(model)
        found = fp16.out_of_range(model, samples)
        keep = fp16.fp32_nodes(model, found)
        fp16.check_share(model, keep, found)
    # keep_io_types: callers keep feeding float32 and reading float32 features.
    converted = convert_float_to_float16(model, keep_io_types=True, node_block_list=keep or None)
    # The converter appends its input Cast after the nodes that read it (ONNX Runtime
    # reorders on load, onnx.checker refuses), e.g. when a Pad comes first.
    topological_sort(converted.graph)
    onnx.save(converted, str(dst))
    return keep


def topological_sort(graph: onnx.GraphProto) -> None:
    """Reorder ``graph``'s nodes so that every input is produced before it is read."""
    known = {v.name for v in graph.input} | {t.name for t in graph.initializer} | {""}
    pending = [onnx.NodeProto.FromString(n.SerializeToString()) for n in graph.node]
    ordered: list[onnx.NodeProto] = []
    while pending:
        ready = [i for i, n in enumerate(pending) if all(x in known for x in n.input)]
        if not ready:
            raise ValueError(f"graph {graph.name!r} reads a value no node produces")
        for i in ready:
            known.update(pending[i].output)
        ordered += [pending[i] for i in ready]
        pending = [n for i, n in enumerate(pending) if i not in set(ready)]
    del graph.node[:]
    graph.node.extend(ordered)


class _Calibration:
    """Feeds calibration batches to the quantizer (onnxruntime's CalibrationDataReader)."""

    def __init__(self, samples: np.ndarray, *, batch: int = 32) -> None:
        self._batches = iter([samples[i : i + batch] for i in range(0, len(samples), batch)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        batch = next(self._batches, None)
        return None if batch is None else {INPUT_NAME: batch.astype(np.float32)}

    def rewind(self) -> None:  # pragma: no cover - part of the reader protocol
        pass


def to_int8(
    src: Path, dst: Path, *, calibration: np.ndarray, seven_bit_weights: bool = False
) -> None:
    """Static int8 quantization in QDQ format, per-channel weights, calibrated on
    ``calibration`` (already preprocessed inputs, (N, C, H, W)); the weights' integer
    values are then chosen by error-compensating rounding (:mod:`export.rounding`) on the
    same calibration inputs.

    ``seven_bit_weights`` keeps the weights of every convolution computed as a matrix
    product in [-64, 64]: x86 CPUs without VNNI multiply uint8 activations by int8 weights
    with an instruction whose 16-bit pair sums saturate (255 * 127 * 2 > 32767), and
    networks whose ReLU6 activations often sit at the top of their range saturate often;
    with 7-bit weights no pair can. Depthwise convolutions keep 8 bits: ONNX Runtime's
    depthwise kernel widens to 16 bits before multiplying and cannot saturate."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(_Calibration, CalibrationDataReader):
        pass

    with tempfile.TemporaryDirectory() as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        # Folding and shape inference first make the quantizer see fused Conv+BN nodes.
        quant_pre_process(str(src), str(prepared), skip_symbolic_shape=True)
        float_model = onnx.load(str(prepared))
        overrides = _seven_bit_overrides(float_model) if seven_bit_weights else {}
        quantize_static(
            str(prepared),
            str(dst),
            Reader(calibration),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            extra_options={"TensorQuantOverrides": overrides} if overrides else None,
        )
    quantized = onnx.load(str(dst))
    hessians = rounding.collect(float_model, calibration, input_name=INPUT_NAME)
    rounding.apply(quantized, float_model, hessians)
    onnx.save(quantized, str(dst))


def _seven_bit_overrides(model: onnx.ModelProto) -> dict[str, list[dict[str, object]]]:
    """ONNX Runtime's per-tensor overrides giving every non-depthwise Conv weight 7 bits."""
    shapes = {t.name: tuple(t.dims) for t in model.graph.initializer}
    overrides: dict[str, list[dict[str, object]]] = {}
    for node in model.graph.node:
        shape = shapes.get(node.input[1]) if node.op_type == "Conv" else None
        if shape is None:
            continue
        group = next((a.i for a in node.attribute if a.name == "group"), 1)
        if group > 1 and shape[1] == 1:
            continue  # depthwise
        # Per-channel overrides: one entry per output channel, the first naming the axis.
        first: dict[str, object] = {"reduce_range": True, "axis": 0}
        overrides[node.input[1]] = [first] + [{"reduce_range": True} for _ in range(shape[0] - 1)]
    return overrides


def prototype_agreement(
    reference: np.ndarray,
    candidate: np.ndarray,
    *,
    labels: np.ndarray | None = None,
    classes: int = 10,
    seed: int = 0,
) -> float:
    """Fraction of samples whose nearest prototype (by dot product) is the same under the
    reference and candidate features. Prototypes are the per-class means of the reference
    features when ``labels`` are known; otherwise ``classes`` reference rows picked at
    random stand in for them. Both feature sets are scored against the same (reference)
    prototypes, as a device would be after switching precision."""
    if labels is not None:
        protos = np.stack([reference[labels == c].mean(axis=0) for c in np.unique(labels)])
    else:
        rng = np.random.default_rng(seed)
        k = min(classes, len(reference))
        protos = reference[rng.choice(len(reference), size=k, replace=False)]
    ref = np.argmax(reference @ protos.T, axis=1)
    cand = np.argmax(candidate @ protos.T, axis=1)
    return float(np.mean(ref == cand))

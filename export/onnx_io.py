"""Export a torch backbone to ONNX and check the result against torch."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from google.protobuf.message import DecodeError
from torch import nn

from export.bundle import INPUT_NAME
from export.errors import ExportError
from export.graph_passes import fold_pads_into_convs

OPSET = 17
OUTPUT_NAME = "features"


def export_onnx(
    model: nn.Module, path: Path, *, input_shape: tuple[int, int, int], opset: int = OPSET
) -> None:
    """Export ``model`` (eval mode) with a dynamic batch axis and constant folding."""
    if opset < 17:
        raise ExportError(f"opset must be at least 17, got {opset}")
    model = model.eval()
    example = torch.zeros(2, *input_shape)
    with torch.inference_mode():
        feature_dim = int(model(example).shape[1])
    with warnings.catch_warnings():
        # The TorchScript-based exporter is deprecated upstream but is the one that
        # handles dynamic_axes, TorchScript inputs and every op used here without onnxscript.
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (example,),
            str(path),
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
            opset_version=opset,
            do_constant_folding=True,
            dynamo=False,
        )
    # Reshapes computed from x.shape (as in attention) leave the feature axis symbolic;
    # the runtime and the manifest need it fixed.
    proto = onnx.load(str(path))
    dim = proto.graph.output[0].type.tensor_type.shape.dim[1]
    changed = fold_pads_into_convs(proto) > 0
    if not dim.HasField("dim_value"):
        dim.ClearField("dim_param")
        dim.dim_value = feature_dim
        changed = True
    if changed:
        onnx.save(proto, str(path))
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"{path.name}: exported model fails onnx.checker: {exc}") from exc


def onnx_info(path: Path) -> tuple[tuple[int, ...], int, int]:
    """(input shape without batch, output dim, opset) read from an ONNX file."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except DecodeError as exc:
        # A truncated download or a file that is not ONNX at all: a user's mistake,
        # not a bug, so it gets a line, not protobuf's traceback.
        raise ExportError(f"{path.name}: not an ONNX model ({exc})") from exc
    if len(model.graph.input) != 1 or len(model.graph.output) != 1:
        raise ExportError(f"{path.name}: a backbone needs exactly one input and one output")

    def dims(value: onnx.ValueInfoProto) -> list[int | str]:
        return [
            d.dim_value if d.HasField("dim_value") else d.dim_param
            for d in value.type.tensor_type.shape.dim
        ]

    inp, out = dims(model.graph.input[0]), dims(model.graph.output[0])
    if len(inp) != 4 or not all(isinstance(d, int) and d > 0 for d in inp[1:]):
        raise ExportError(
            f"{path.name}: input must be (batch, C, H, W) with fixed C, H, W; got {inp}"
        )
    if len(out) != 2 or not isinstance(out[1], int) or out[1] <= 0:
        raise ExportError(f"{path.name}: output must be (batch, features); got {out}")
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    return tuple(int(d) for d in inp[1:]), int(out[1]), int(opset)


@dataclass(frozen=True)
class Parity:
    max_abs_error: float
    min_cosine: float

    def to_json(self) -> dict[str, float]:
        return {"max_abs_error": self.max_abs_error, "min_cosine": self.min_cosine}


def compare(reference: np.ndarray, candidate: np.ndarray) -> Parity:
    """Elementwise and per-row cosine agreement of two feature matrices."""
    ref = reference.astype(np.float64)
    cand = candidate.astype(np.float64)
    err = float(np.max(np.abs(ref - cand))) if ref.size else 0.0
    num = np.sum(ref * cand, axis=1)
    den = np.linalg.norm(ref, axis=1) * np.linalg.norm(cand, axis=1)
    cos = np.where(den > 0, num / np.maximum(den, 1e-30), 1.0)
    return Parity(max_abs_error=err, min_cosine=float(cos.min()) if cos.size else 1.0)


def torch_features(model: nn.Module, inputs: np.ndarray, *, batch: int = 64) -> np.ndarray:
    model = model.eval()
    outs = []
    with torch.inference_mode():
        for start in range(0, len(inputs), batch):
            outs.append(model(torch.from_numpy(inputs[start : start + batch])).numpy())
    return np.concatenate(outs).astype(np.float32)

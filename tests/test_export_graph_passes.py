"""Graph rewrites of an exported model: a zero Pad in front of a Conv becomes the Conv's
own padding, and nothing else changes what the model computes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from export.graph_passes import fold_pads_into_convs
from export.onnx_io import export_onnx


class PadConv(nn.Module):
    def __init__(self, pad: tuple[int, int, int, int], *, mode: str = "constant") -> None:
        super().__init__()
        self.pad, self.mode = pad, mode
        self.conv = nn.Conv2d(3, 4, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(nn.functional.pad(x, self.pad, mode=self.mode))
        return torch.flatten(y.mean(dim=(2, 3)), 1)


def _export(model: nn.Module, path: Path) -> onnx.ModelProto:
    torch.manual_seed(0)
    export_onnx(model, path, input_shape=(3, 10, 10))
    return onnx.load(str(path))


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"input": x})[0]


def test_zero_pad_before_conv_is_folded_into_its_pads(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = PadConv((0, 1, 2, 3)).eval()  # left 0, right 1, top 2, bottom 3
    exported = _export(model, tmp_path / "m.onnx")
    ops = [n.op_type for n in exported.graph.node]
    assert "Pad" not in ops
    conv = next(n for n in exported.graph.node if n.op_type == "Conv")
    pads = next(a for a in conv.attribute if a.name == "pads").ints
    # Conv's own 1 on every side plus the Pad's: [top, left, bottom, right].
    assert list(pads) == [3, 1, 4, 2]
    x = np.random.default_rng(0).standard_normal((2, 3, 10, 10)).astype(np.float32)
    with torch.inference_mode():
        expected = model(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(_run(exported, x), expected, atol=1e-5)


def test_a_reflecting_pad_is_left_alone(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = PadConv((1, 1, 1, 1), mode="reflect").eval()
    torch.onnx.export(
        model, (torch.zeros(1, 3, 10, 10),), str(tmp_path / "r.onnx"),
        input_names=["input"], opset_version=17, dynamo=False,
    )  # fmt: skip
    proto = onnx.load(str(tmp_path / "r.onnx"))
    assert fold_pads_into_convs(proto) == 0
    assert "Pad" in [n.op_type for n in proto.graph.node]

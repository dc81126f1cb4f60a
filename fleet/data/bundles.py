"""The backbone bundle a fleet command runs on: ``--bundle`` and ``--backbone`` resolved,
and the zoo or a pretrained backbone built once where none is."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from closed_form.basis import BASIS_FILE
from export import bundle as bundle_mod
from export.errors import BundleError
from runtime.cliutil import CommandFailed, UsageError
from runtime.runlock import RunLock

BIN = Path(sys.executable).parent

#: ``--backbone``: the ``edge-export`` arguments that build each into a bundle folder.
BACKBONES: dict[str, list[str]] = {
    "zoo": ["zoo"],
    # One 192-d backbone: a simulated client's head is 1/4.5 of the full zoo's, which is
    # what lets 10,000 of them train in one machine's memory (--transport vector).
    "zoo-fontdigits": ["zoo", "--members", "fontdigits"],
    "effnet-lite0": ["bundle", "--backbone", "name=effnet-lite0,pretrained=efficientnet-lite0"],
}


def resolve_bundle(bundle: Path | None, *, backbone: str | None) -> Path:
    """``--bundle``, by default runs/BACKBONE; a bundle already there must be what an
    explicit ``--backbone`` asks for (a zoo silently used for effnet-lite0 would mislead)."""
    path = Path("runs") / (backbone or "zoo") if bundle is None else bundle
    if backbone is None or not (path / "bundle.json").exists():
        return path
    try:
        held = bundle_kind(bundle_mod.load(path, check_hashes=False))
    except BundleError as exc:
        raise UsageError(str(exc)) from None
    if held != backbone:
        raise UsageError(
            f"--bundle {path} holds {held or 'other backbones'}, not --backbone "
            f"{backbone}; choose another --bundle (or none: runs/{backbone})"
        )
    return path


def bundle_kind(bundle: Any) -> str | None:
    """Which ``--backbone`` built ``bundle`` (None: neither)."""
    if "zoo" in bundle.extra:
        members = bundle.extra["zoo"].get("members")
        return "zoo-fontdigits" if members == ["fontdigits"] else "zoo"
    pretrained = [m.provenance.get("pretrained") for m in bundle.members]
    return "effnet-lite0" if pretrained == ["efficientnet-lite0"] else None


def ensure_basis(path: Path) -> Path:
    """The bundle's public basis for closed-form fleets (``basis.npy``), written once
    with ``edge-export basis`` if missing (about 20 seconds for the zoo)."""
    basis = path / BASIS_FILE
    if basis.exists():
        return basis
    print(f"writing the public basis of {path} (once) ...", file=sys.stderr, flush=True)
    done = subprocess.run([str(BIN / "edge-export"), "basis", str(path)],
                          stdout=subprocess.DEVNULL)  # fmt: skip
    if done.returncode != 0:
        raise CommandFailed(f"writing the public basis of {path} failed (exit {done.returncode})")
    return basis


def ensure_bundle(path: Path, size: str, *, backbone: str = "zoo") -> Path:
    """``path`` if it holds a bundle; else ``backbone`` (the zoo of ``size``, or a
    pretrained backbone), built there once.

    The zoo is built in a staging folder beside ``path`` and moved into place when it is
    whole: a build cut short (Ctrl-C in the minutes it takes) leaves no half-written
    bundle at ``path`` for the next run to trip over, and the next run starts it afresh.
    """
    if (path / "bundle.json").exists():
        return path
    # Two sweeps started at once on a fresh clone: the second waits for the first's build
    # (it used to delete the first's staging folder as an interrupted build's leftover).
    with RunLock.take(
        path.with_name(f".{path.name}.lock"),
        what=f"the zoo in {path}",
        wait=lambda message: print(message, file=sys.stderr, flush=True),
    ) as lock:
        if (path / "bundle.json").exists():
            return path  # the other sweep built it
        if path.exists() and any(path.iterdir()):
            raise UsageError(f"{path} exists but holds no bundle.json")
        staging = path.with_name(f".{path.name}.building")
        if staging.exists():
            shutil.rmtree(staging)  # what an interrupted build left
        what = f"the {size} backbone {backbone}" if backbone.startswith("zoo") else backbone
        print(f"building {what} in {path} (once) ...", file=sys.stderr, flush=True)
        argv = [str(BIN / "edge-export"), *BACKBONES[backbone], "--out", str(staging)]
        done = subprocess.run(
            argv + (["--size", size] if backbone.startswith("zoo") else []),
            stdout=subprocess.DEVNULL,
        )
        if done.returncode != 0:
            raise CommandFailed(f"building {what} failed (exit {done.returncode})")
        staging.replace(path)  # onto nothing or an empty folder: atomic
        # Safe to remove now that bundle.json is there: a waiter holding the old file's
        # lock, and anyone later, finds the bundle first and never builds.
        lock.path.unlink(missing_ok=True)
        return path

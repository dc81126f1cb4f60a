"""Sweeps that survive a crash: each finished run leaves ``result.json`` in its folder, and
``--resume`` reads those back instead of running them again.

A sweep of six methods x three seeds, or a privacy sweep, is many runs; a crash, a
Ctrl-C or a reboot in the last one should cost that run, not the sweep. A run counts as
finished only when its ``result.json`` exists (written atomically, last) and was made with
the same settings, data and bundle; anything else in its folder is a run cut short, and is
removed and run again from round 0 (agents and coordinator restart together, so nothing is
counted twice).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge_agent.features import fingerprint as data_fingerprint
from export import bundle as bundle_mod
from export.errors import BundleError
from fleet.data.partition import Partition
from fleet.transports.spec import ClientRecord, RunResult, RunSpec
from runtime.cliutil import UsageError
from runtime.files import atomic_write
from secagg.fleet import SecureAggregation

log = logging.getLogger(__name__)

# Settings that change how a run is carried out but not what it computes.
_NOT_IN_KEY = frozenset({"out", "progress", "workers", "broker", "feature_cache"})


def sweep_dir(out: Path, *, resume: bool) -> Path:
    """A new time-stamped folder for a sweep's runs, or with ``resume`` the newest one."""
    runs = out / "runs"
    if not resume:
        return runs / time.strftime("%Y%m%d-%H%M%S")
    earlier = sorted(p for p in runs.glob("*") if p.is_dir()) if runs.is_dir() else []
    if not earlier:
        raise UsageError(f"--resume: no earlier sweep under {runs}")
    return earlier[-1]


def fingerprint(spec: RunSpec, partition: Partition) -> str:
    """What a run's result depends on: its settings, every array of its data, the bundle."""
    # The data by the agent's own fingerprint (the feature cache's key), the backbones by
    # the bundle's id.
    settings = {
        k: str(v) if isinstance(v, Path) else v
        for k, v in dataclasses.asdict(spec).items()
        if k not in _NOT_IN_KEY
    }
    try:
        settings["bundle"] = bundle_mod.load(spec.bundle, check_hashes=False).id
    except BundleError as exc:
        raise UsageError(str(exc)) from exc
    data = [
        [c.name, c.domain, data_fingerprint(c.train_x, c.train_y),
         data_fingerprint(c.test_x, c.test_y)]
        for c in partition.clients
    ]  # fmt: skip
    document = {"settings": settings, "classes": partition.classes, "data": data}
    return hashlib.sha256(json.dumps(document, sort_keys=True, default=str).encode()).hexdigest()


def save(result: RunResult, key: str) -> Path:
    document = {
        "key": key,
        "clients": [dataclasses.asdict(c) for c in result.clients],
        "round_seconds": list(result.round_seconds),
        "peak_mb": result.peak_mb,
        "wall_seconds": result.wall_seconds,
        "backbone_samples": result.backbone_samples,
        "secure": None if result.secure is None else dataclasses.asdict(result.secure),
    }
    path = result.spec.layout.result
    atomic_write(path, json.dumps(document).encode())  # a crash leaves none or all of it
    return path


def load(spec: RunSpec, key: str) -> RunResult | None:
    """The finished run in ``spec.out`` if it was made with ``key``; otherwise None."""
    try:
        document = json.loads(spec.layout.result.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(document, dict) or document.get("key") != key:
        return None
    try:
        clients = tuple(_record(c) for c in document["clients"])
        return RunResult(
            spec=spec,
            clients=clients,
            round_seconds=tuple(document["round_seconds"]),
            peak_mb=float(document["peak_mb"]),
            wall_seconds=float(document["wall_seconds"]),
            backbone_samples=document["backbone_samples"],
            secure=SecureAggregation(**secure) if (secure := document.get("secure")) else None,
        )
    except (KeyError, TypeError, ValueError):
        return None  # an older or damaged record: run again


def _record(fields: dict[str, Any]) -> ClientRecord:
    lists = {k: tuple(v) for k, v in fields.items() if isinstance(v, list)}
    return ClientRecord(**{**fields, **lists})


def run_or_resume(
    spec: RunSpec, partition: Partition, *, run: Callable[[RunSpec, Partition], RunResult]
) -> tuple[RunResult, bool]:
    """(result, True) for a run finished earlier with the same key; else run it, from a
    clean folder, and record it: (result, False)."""
    key = fingerprint(spec, partition)
    earlier = load(spec, key)
    if earlier is not None:
        log.info("%s: finished earlier, read back from %s", spec.out.name, spec.layout.result)
        return earlier, True
    if spec.out.exists():
        log.info("%s: cut short or made with other settings; running it again", spec.out.name)
        shutil.rmtree(spec.out)
    result = run(spec, partition)
    save(result, key)
    return result, False

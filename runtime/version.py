"""The installed distribution's version, reported in ``--version`` and agent status."""

from __future__ import annotations

from importlib import metadata


def package_version() -> str:
    try:
        return metadata.version("protofleet")
    except metadata.PackageNotFoundError:  # running from a source tree that is not installed
        return "0.0.0+source"

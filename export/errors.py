"""Errors of the export package."""

from __future__ import annotations


class ExportError(RuntimeError):
    """A backbone could not be loaded, exported or checked."""


class BundleError(ExportError):
    """A bundle is missing, malformed, or its files do not match their recorded hashes."""

    def __init__(self, message: str, *, file: str | None = None) -> None:
        self.file = file
        super().__init__(message)

"""TOML files mapped onto frozen dataclasses, with errors that name the offending key.

Shared by the agent's and the coordinator's configuration. Supported field types: str,
int, float, bool, Path, Literal[...], X | None, tuple[X, ...], Mapping[str, scalar] and
nested dataclasses. Unknown keys are errors, so a typo never silently falls back to a
default. A relative path in a file is taken from the file's folder, not from wherever the
process happens to run (``/`` under systemd).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 (JetPack 6)
    import tomli as tomllib

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration file or value is invalid; ``key`` is the dotted path to it."""

    def __init__(self, message: str, *, key: str = "", source: str = "") -> None:
        self.key, self.detail = key, message
        where = f"{source}: " if source else ""
        at = f"{key}: " if key else ""
        super().__init__(f"{where}{at}{message}")


def load_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError("file not found", source=str(path)) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"not valid TOML: {exc}", source=str(path)) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"not a UTF-8 text file (byte {exc.object[exc.start]:#04x} at offset {exc.start})",
            source=str(path),
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", source=str(path)) from exc


def parse_value(raw: str) -> Any:
    """A value given on a command line, read as TOML (``0.2``, ``1e-4``, ``true``,
    ``"text"``); anything that is not a TOML value (a bare word) is the string itself."""
    try:
        return tomllib.loads(f"value = {raw}")["value"]
    except tomllib.TOMLDecodeError:
        return raw


def load_config(cls: type[T], path: Path) -> T:
    """Read ``path`` and build ``cls`` from it; every error is a :class:`ConfigError`."""
    data = load_toml(path)
    try:
        return build(cls, data, base=path.absolute().parent)
    except ConfigError as exc:
        raise ConfigError(exc.detail, key=exc.key, source=str(path)) from None


def build(
    cls: type[T], data: Mapping[str, Any], *, prefix: str = "", base: Path | None = None
) -> T:
    """Build dataclass ``cls`` from a mapping, converting and checking every field;
    relative paths are joined to ``base`` when one is given."""
    if not isinstance(data, Mapping):
        raise ConfigError("expected a table", key=prefix.rstrip("."))
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown key(s) {unknown}; known: {sorted(fields)}", key=prefix.rstrip(".")
        )
    values = {}
    for name, field in fields.items():
        key = prefix + name
        if name in data:
            values[name] = _convert(hints[name], data[name], key, base)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError("required key is missing", key=key)
    try:
        return cls(**values)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(str(exc), key=prefix.rstrip(".")) from exc


def _convert(hint: Any, value: Any, key: str, base: Path | None) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _convert(options[0], value, key, base)
        raise ConfigError(f"unsupported union type {hint}", key=key)
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{value!r} is not one of {list(args)}", key=key)
        return value
    if origin is tuple:
        if not isinstance(value, list):
            raise ConfigError(f"expected a list, got {type(value).__name__}", key=key)
        return tuple(_convert(args[0], v, f"{key}[{i}]", base) for i, v in enumerate(value))
    if origin in (dict, Mapping, typing.Mapping) or hint in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"expected a table, got {type(value).__name__}", key=key)
        for k, v in value.items():
            if not isinstance(v, (str, int, float, bool)):
                raise ConfigError(
                    f"values must be scalars, got {type(v).__name__}", key=f"{key}.{k}"
                )
        return dict(value)
    if dataclasses.is_dataclass(hint):
        return build(hint, value, prefix=key + ".", base=base)  # type: ignore[arg-type]
    if hint is Path:
        if not isinstance(value, str) or not value:
            raise ConfigError("expected a path string", key=key)
        path = Path(value).expanduser()
        return base / path if base is not None and not path.is_absolute() else path
    if hint is float:
        if type(value) not in (int, float):
            raise ConfigError(f"expected a number, got {type(value).__name__}", key=key)
        if not math.isfinite(value):  # TOML has inf and nan; no setting means them
            raise ConfigError(f"must be a finite number, got {value}", key=key)
        return float(value)
    if hint in (int, str, bool):
        if type(value) is not hint:
            raise ConfigError(f"expected {hint.__name__}, got {type(value).__name__}", key=key)
        return value
    raise ConfigError(f"unsupported field type {hint}", key=key)

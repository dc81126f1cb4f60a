"""``example-config``: a service's configuration file with every key of its dataclasses.

The keys and their defaults come from the configuration dataclasses, so the example cannot
miss a key or show a stale default. Their order, the example values of required keys and
every comment come from the commented file shipped beside the service (the notes:
edge_agent/agent.toml, coordinator/coordinator.toml). A key the notes lack is still listed,
bare; a test holds each shipped file equal to what is rendered from it, so the file a
user copies and the command's output are one text.

Regenerate the shipped files after adding a key: ``python -m tests.example_configs``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from runtime.settings import tomllib

#: ``key = value  # comment`` or the same commented out (``# key = value``).
_KEY = re.compile(r"^(?P<off>#\s*)?(?P<key>[A-Za-z_][A-Za-z0-9_]*)\s*=\s*(?P<rest>.*)$")
_TABLE = re.compile(r"^\[(?P<name>[A-Za-z0-9_.]+)\]")


@dataclasses.dataclass
class _Line:
    """A key's line in the notes and the comment lines that continue it."""

    text: str
    commented: bool
    value: str  # the TOML value as written
    lines: list[str]


@dataclasses.dataclass
class _Section:
    header: list[str]  # "[table]  # comment" and its continuation lines; [] for the root
    keys: dict[str, _Line]
    body: list[str]  # every line after the header, verbatim (a free-form table's)


def _split_value(rest: str) -> str:
    """The TOML value at the start of ``rest`` (``value  # comment``)."""
    cuts = [i for i, ch in enumerate(rest) if ch == "#"] + [len(rest)]
    for cut in cuts:
        try:
            tomllib.loads(f"v = {rest[:cut]}")
        except tomllib.TOMLDecodeError:
            continue
        return rest[:cut].rstrip()
    return rest.strip()


def _read_notes(text: str) -> tuple[list[str], dict[str, _Section]]:
    """The preamble and the sections of the notes, keyed by table name ("" the root)."""
    preamble: list[str] = []
    sections: dict[str, _Section] = {"": _Section([], {}, [])}
    current = sections[""]
    last: _Line | None = None
    started = False
    for line in text.splitlines():
        table = _TABLE.match(line)
        key = _KEY.match(line)
        if table:
            current = sections.setdefault(table.group("name"), _Section([line], {}, []))
            started, last = True, None
        elif key and not line.startswith(" "):
            rest = key.group("rest")
            last = _Line(line, bool(key.group("off")), _split_value(rest), [line])
            current.keys[key.group("key")] = last
            current.body.append(line)
            started = True
        elif line.strip().startswith("#") and line.startswith(" "):
            # A comment continuing the line above: a key's, or the table header's.
            (last.lines if last is not None else current.header).append(line)
            current.body.append(line)
        elif not started:
            preamble.append(line)
        elif line.strip():
            current.body.append(line)
    return preamble, sections


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, Path)):
        return json.dumps(str(value))
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def _same(written: str, default: Any) -> bool:
    try:
        value = tomllib.loads(f"v = {written}")["v"]
    except tomllib.TOMLDecodeError:
        return False
    if isinstance(default, tuple):
        default = list(default)
    elif isinstance(default, Path):
        default = str(default)
    return bool((value == default and type(value) is type(default)) or _numbers(value, default))


def _numbers(a: Any, b: Any) -> bool:
    numeric = (int, float)
    plain = not isinstance(a, bool) and not isinstance(b, bool)
    return plain and isinstance(a, numeric) and isinstance(b, numeric) and float(a) == float(b)


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _is_table(hint: Any) -> bool:
    origin = typing.get_origin(hint)
    return dataclasses.is_dataclass(hint) or origin in (dict, Mapping) or hint in (dict, Mapping)


def _key_line(name: str, field: dataclasses.Field[Any], note: _Line | None) -> list[str]:
    default = _default(field)
    if note is not None and (
        default is dataclasses.MISSING
        or default is None
        or note.commented
        or _same(note.value, default)
    ):
        return note.lines
    if default is dataclasses.MISSING:
        return [f'{name} = ""  # required']
    if default is None:
        return [f"# {name} =  # unset by default"]
    text = f"{name} = {_toml(default)}"
    if note is None:
        return [text]
    # The notes' comment, at its column, after the dataclass's default.
    first = note.lines[0]
    comment = first.find("#", first.find(note.value) + len(note.value))
    if comment < 0:
        return [text, *note.lines[1:]]
    return [text.ljust(comment - 1) + " " + first[comment:], *note.lines[1:]]


def _ordered(names: list[str], notes: Mapping[str, object]) -> list[str]:
    """``names`` in the notes' order, those the notes lack after them in their own."""
    known = [n for n in notes if n in names]
    return known + [n for n in names if n not in known]


def _render_table(cls: type, path: str, sections: Mapping[str, _Section], out: list[str]) -> None:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    section = sections.get(path, _Section([f"[{path}]"] if path else [], {}, []))
    if path:
        out.extend(["", *section.header])
    scalars = [n for n in fields if not _is_table(hints[n])]
    for name in _ordered(scalars, section.keys):
        out.extend(_key_line(name, fields[name], section.keys.get(name)))
    tables = [n for n in fields if _is_table(hints[n])]
    prefix = f"{path}." if path else ""
    for name in _ordered(tables, {s[len(prefix) :]: s for s in sections if s.startswith(prefix)}):
        sub = prefix + name
        if dataclasses.is_dataclass(hints[name]):
            _render_table(hints[name], sub, sections, out)
        else:
            # A free-form table (model.params): its keys are the user's; the notes show some.
            free = sections.get(sub, _Section([f"[{sub}]"], {}, []))
            out.extend(["", *free.header, *free.body[len(free.header) - 1 :]])


def render(cls: type, notes: str) -> str:
    """The example configuration of dataclass ``cls``, laid out and commented by ``notes``."""
    preamble, sections = _read_notes(notes)
    out = list(preamble)
    while out and not out[-1].strip():
        out.pop()
    out.append("")
    _render_table(cls, "", sections, out)
    return "\n".join(out) + "\n"


def _leaves(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field[Any], Any]]:
    """(dotted key, field, type hint) of every key of dataclass ``cls``: a nested
    dataclass is walked into, a free-form table is one key."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            yield from _leaves(hint, f"{prefix}{field.name}.")  # type: ignore[arg-type]
        else:
            yield prefix + field.name, field, hint


def keys(cls: type, prefix: str = "") -> Iterator[str]:
    """Every dotted key of dataclass ``cls``; a free-form table is one key."""
    return (key for key, _, _ in _leaves(cls, prefix))


def defaults(cls: type, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> default of every key of dataclass ``cls`` that has one."""
    return {
        key: value
        for key, field, _ in _leaves(cls, prefix)
        if (value := _default(field)) is not dataclasses.MISSING
    }


def free_tables(cls: type, prefix: str = "") -> Iterator[str]:
    """The dotted names of the free-form tables (mappings) of dataclass ``cls``."""
    return (key for key, _, hint in _leaves(cls, prefix) if _is_table(hint))

"""The measured results a figure is made from, and how a figure writes a number.

bench/results.json (``make bench``), bench/accuracy.json (``make bench-accuracy``) and
bench/closed_form.json (``make bench-closed-form``) hold
sections, each with the run (date, commit, machine) that measured it; a key is read with
the section it came from, so every figure can say where its numbers were measured.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SOURCES = (HERE / "results.json", HERE / "accuracy.json", HERE / "closed_form.json")
#: The section of bench/accuracy.json; every other section is a performance benchmark.
ACCURACY = "bench.accuracy_bench"
#: The section of bench/closed_form.json.
CLOSED_FORM = "bench.closed_form_bench"


@dataclass(frozen=True)
class Results:
    """Every measured key, with the section (and so the run) it comes from."""

    values: dict[str, float]
    section_of: dict[str, str]
    sections: dict[str, dict[str, Any]]

    @classmethod
    def load(cls, paths: tuple[Path, ...] = SOURCES) -> Results:
        values: dict[str, float] = {}
        section_of: dict[str, str] = {}
        sections: dict[str, dict[str, Any]] = {}
        for path in paths:
            if not path.exists():
                continue
            document = json.loads(path.read_text())
            for name, section in document.get("sections", {}).items():
                sections[name] = section
                for key, value in section["results"].items():
                    values[key] = value
                    section_of[key] = name
        return cls(values, section_of, sections)

    def get(self, key: str) -> float | None:
        return self.values.get(key)

    def provenance(self, section: str) -> str:
        """'2026-11-25, commit 1a2b3c4d5e6f, 2 cores (AMD EPYC)' or 'not measured'; with
        ', STALE: why' when a later change moved what the section measures and it was not
        measured again (the section's ``stale``, set by hand in the results file and
        dropped by the next run of its benchmark)."""
        s = self.sections.get(section)
        if s is None:
            return "not measured"
        m = s["machine"]
        run = f"{s['date'][:10]}, commit {s['commit']}, {m['cores']} cores ({m['cpu']})"
        return f"{run}, STALE: {s['stale']}" if s.get("stale") else run


def pct(value: float | None) -> str:
    """A fraction as a percentage with one decimal; ``-`` for a cell not measured."""
    return "-" if value is None else f"{100 * value:.1f}"


def num(value: float | None) -> str:
    """A measured figure at a precision its size warrants, or "not measured"."""
    if value is None:
        return "not measured"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"

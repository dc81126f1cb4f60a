"""bench/run.py writes only what it measured; bench/figures.py generates the figures of
README.md and docs/ from the committed results files."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import figures
from bench import run as bench_run


def test_a_results_file_holds_only_this_runs_sections_each_stamped(tmp_path: Path) -> None:
    def load(name: str) -> SimpleNamespace:
        if name == "bench.broken":
            return SimpleNamespace(run=lambda: 1 / 0)
        return SimpleNamespace(run=lambda: {"ok.b": 2.0, "ok.a": 1.0})

    out = tmp_path / "results.json"
    # An earlier file with a section this run does not measure: it must not survive.
    out.write_text(json.dumps({"format": 2, "sections": {"bench.old": {"results": {"x": 1}}}}))
    sections, failed = bench_run.measure(["bench.ok", "bench.broken"], load=load)
    bench_run.write(out, sections)
    assert failed == ["bench.broken"]
    document = json.loads(out.read_text())
    assert list(document["sections"]) == ["bench.ok"]  # no broken, no old
    section = document["sections"]["bench.ok"]
    assert section["results"] == {"ok.a": 1.0, "ok.b": 2.0}
    assert section["date"][:2] == "20" and "T" in section["date"]
    assert section["machine"]["cores"] >= 1 and section["machine"]["cpu"]
    assert section["commit"] != "unknown"  # the tests run in a git checkout


def test_a_section_that_cannot_measure_here_is_recorded_as_skipped_with_its_reason() -> None:
    def skip() -> dict[str, float]:
        raise bench_run.Skipped("Flower is not installed")

    sections, failed = bench_run.measure(["bench.peer"], load=lambda _: SimpleNamespace(run=skip))
    assert failed == []  # not a failure: the run says why, and carries no figure
    assert sections["bench.peer"]["skipped"] == "Flower is not installed"
    assert sections["bench.peer"]["results"] == {}


def test_figures_come_from_the_results_and_say_what_was_not_measured(tmp_path: Path) -> None:
    stamp = {"date": "2026-01-02T03:04:05+00:00", "commit": "abc", "seconds": 1.0,
             "machine": {"cores": 2, "cpu": "Some CPU"}}  # fmt: skip
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"sections": {"bench.fleet_bench": {**stamp, "results": {
        "fleet.bytes_up_per_client_round_fedpcl": 5400.0,
        "fleet.bytes_up_per_client_round_fedavg": 938000.0}}}}))  # fmt: skip
    results = figures.Results.load((path, tmp_path / "absent.json"))
    text = "a\n<!-- figures:traffic -->\nold 1.0 kB\n<!-- /figures:traffic -->\nb\n"
    new = figures.render(text, results)
    assert new == (
        "a\n<!-- figures:traffic -->\nPrototypes cost 5.4 kB per device per round; FedAvg's "
        "weights 938 kB (`make bench`: 2026-01-02, commit abc, 2 cores (Some CPU)).\n"
        "<!-- /figures:traffic -->\nb\n"
    )
    assert figures.render(new, results) == new  # regenerating changes nothing
    table = figures.render("<!-- figures:bench-table -->\n<!-- /figures:bench-table -->", results)
    assert "| **fleet_bench** | 2026-01-02, commit abc, 2 cores (Some CPU) |" in table
    assert "| `fleet.bytes_up_per_client_round_fedavg` | 938,000 |" in table
    # Accuracy figures that were not measured are said to be, not left as they were.
    stale = "<!-- figures:fair-table -->\n| fedpcl | 99.9 |\n<!-- /figures:fair-table -->"
    assert "Not measured" in figures.render(stale, results)
    assert "99.9" not in figures.render(stale, results)
    with pytest.raises(KeyError, match="figures:nope"):
        figures.render("<!-- figures:nope -->\n<!-- /figures:nope -->", results)


def test_the_commit_stamp_says_changes_for_code_not_for_the_results_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run rewrites the results files, so a tree changed only there is still the commit;
    a changed source file is not."""
    import subprocess

    def git(*argv: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *argv], check=True,
                              capture_output=True, text=True).stdout.strip()  # fmt: skip

    (tmp_path / "bench").mkdir()
    results = tmp_path / "bench" / "results.json"
    results.write_text("{}")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = git("rev-parse", "--short=12", "HEAD")
    monkeypatch.setattr(bench_run, "ROOT", tmp_path)
    monkeypatch.setattr(bench_run, "RESULTS", {"perf": results})
    results.write_text('{"format": 2}')
    assert bench_run.commit() == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert bench_run.commit() == head + "+changes"


def test_the_committed_docs_match_the_committed_results() -> None:
    """Every generated block of README.md and docs/ is what `make figures` makes of
    bench/results.json and bench/accuracy.json as committed: a figure edited by hand, or
    results refreshed without `make figures`, fails here."""
    marked = [p for p in figures.FILES if figures.BLOCK.search(p.read_text())]
    assert marked == list(figures.FILES)  # every file listed has generated blocks
    assert all(p.exists() for p in figures.SOURCES)  # the results files are committed
    assert figures.main(["--check"]) == 0

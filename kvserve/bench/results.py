"""Where benchmarks/run.py files its runs, so results accumulate per CPU instead of replacing each
other: benchmarks/results/<cpu-slug>/<name>/ (records.json, per-scenario JSON, plots) beside
<cpu-slug>/<name>.md. Runs from before per-CPU results sit directly in results/<name>/, with a
bare list in records.json and no machine header; they were measured on the Zen 5 machine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvserve.bench.machine import cpu_label, cpu_slug

DEFAULT_MODEL = "smollm2-135m-instruct"  # the model of the standard runs
STANDARD_SCENARIOS = ("s1", "s2", "s3", "s4", "s5")
LEGACY_SLUG = "before-per-cpu-results"
LEGACY_LABEL = "AMD EPYC (Zen 5, before per-CPU results)"


@dataclass(frozen=True)
class SavedRun:
    slug: str
    name: str
    directory: Path  # records.json, per-scenario JSON, plots
    machine: dict | None  # None: a run from before per-CPU results
    records: list[dict]
    written_at: str  # ISO local time; "" for old runs (ordered by name then)
    model: str = DEFAULT_MODEL  # what every system served

    @property
    def markdown_path(self) -> Path:
        return self.directory.parent / f"{self.name}.md"

    @property
    def notes_path(self) -> Path:
        """Hand-written remarks on the run, appended to its section of BENCHMARKS.md."""
        return self.directory.parent / f"{self.name}.notes.md"

    @property
    def label(self) -> str:
        return cpu_label(self.machine) if self.machine else LEGACY_LABEL


def run_directory(results_root: Path, slug: str, name: str) -> Path:
    return results_root / slug / name


def write_dated_result(results_root: Path, header: dict, name: str, rows: list[dict],
                       markdown: list[str]) -> Path:
    """A one-off benchmark's rows and table, filed under this CPU's directory as
    <date>-<name>.json and .md; returns the .md path."""
    import datetime

    directory = results_root / cpu_slug(header)
    directory.mkdir(parents=True, exist_ok=True)
    stem = directory / f"{datetime.date.today().isoformat()}-{name}"
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    stem.with_suffix(".md").write_text("\n".join(markdown) + "\n")
    return stem.with_suffix(".md")


def records_payload(machine: dict, records: list[dict], written_at: str,
                    versions: dict | None = None) -> dict:
    """records.json: the machine header beside every system's record."""
    return {"machine": machine, "written_at": written_at, "versions": versions or {},
            "records": records}


def load_run(records_path: Path, slug: str) -> SavedRun:
    directory = records_path.parent
    data = json.loads(records_path.read_text())
    if isinstance(data, list):
        return SavedRun(slug, directory.name, directory, None, data, "")
    return SavedRun(slug, directory.name, directory, data.get("machine"), data["records"],
                    data.get("written_at", ""), data.get("model", DEFAULT_MODEL))


def saved_runs(results_root: Path) -> list[SavedRun]:
    """Every run with a records.json: old ones at depth one, per-CPU ones at depth two."""
    runs = [load_run(path, LEGACY_SLUG) for path in sorted(results_root.glob("*/records.json"))]
    runs += [load_run(path, path.parent.parent.name)
             for path in sorted(results_root.glob("*/*/records.json"))]
    return runs


def _recency(run: SavedRun) -> tuple[str, str]:
    return run.written_at, run.name


def _headline_rank(run: SavedRun) -> tuple:
    covered = {scenario for record in run.records for scenario in record.get("scenarios", {})}
    with_peer = any(not record.get("system", "").startswith("kvserve") for record in run.records)
    return (run.model == DEFAULT_MODEL, with_peer, len(covered.intersection(STANDARD_SCENARIOS)),
            _recency(run))


def latest_runs(results_root: Path) -> list[SavedRun]:
    """The headline run of each CPU slug, most recent CPU first, the old runs' last: its
    latest run of the default model beside a peer covering the most standard scenarios (a
    later run of one scenario, of another model, or of kvserve's own variants alone, such as
    speculation on and off, is a one-off beside it, not the CPU's table)."""
    latest: dict[str, SavedRun] = {}
    for run in saved_runs(results_root):
        if run.slug not in latest or _headline_rank(run) > _headline_rank(latest[run.slug]):
            latest[run.slug] = run
    return sorted(latest.values(), key=lambda run: (run.slug != LEGACY_SLUG, _recency(run)),
                  reverse=True)
